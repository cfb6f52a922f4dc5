"""Group commit of the file ledger's appends: durability before wake-up, isolation, order."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from participants import FileCaptureLedger, MemoryCaptureLedger
from participants._ledger.group import GroupCommitter, PendingAppend

from .ledger_factory import commit

pytestmark = pytest.mark.anyio

DEADLINE_S = 10.0


class FsyncGate:
    """Logs every ledger-file fsync by file name and holds the one of ``hold`` until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: str) -> None:
        self.synced: list[str] = []
        self.held = threading.Event()
        self._open = threading.Event()
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            if name == hold and not self._open.is_set():
                self.held.set()
                self._open.wait(DEADLINE_S)  # the shard thread stops right before the fsync
            real_fsync(fd)
            if name.endswith(".jsonl"):
                self.synced.append(name)

        monkeypatch.setattr(os, "fsync", fsync)

    async def wait_held(self) -> None:
        assert await anyio.to_thread.run_sync(self.held.wait, DEADLINE_S), "no fsync was held"

    def release(self) -> None:
        self._open.set()


def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` from a worker thread until it holds (at most ``DEADLINE_S``)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


async def outcome(results: dict[str, str], name: str, call: Awaitable[None]) -> None:
    try:
        await call
    except ValueError:
        results[name] = "conflict"
    else:
        results[name] = "ok"


async def test_a_caller_is_woken_only_after_its_row_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FileCaptureLedger(tmp_path)
    gate = FsyncGate(monkeypatch, hold="a.lineage.jsonl")
    results: dict[str, str] = {}
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(outcome, results, "a", ledger.record(commit("a", 0)))
            await gate.wait_held()
            # The row is written, its fsync has not run: give a wrongly early wake-up every
            # chance to arrive before letting the fsync go.
            for _ in range(20):
                await anyio.sleep(0.01)
            assert results == {}
            gate.release()
        assert results == {"a": "ok"}
        assert gate.synced == ["a.lineage.jsonl"]
    finally:
        ledger.close()


async def test_a_conflicting_row_fails_alone_and_its_group_shares_one_fsync_per_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = FileCaptureLedger(tmp_path, commit_threads=1)
    gate = FsyncGate(monkeypatch, hold="first.lineage.jsonl")
    results: dict[str, str] = {}
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(outcome, results, "first", ledger.record(commit("first", 0)))
            await gate.wait_held()  # the only shard thread is busy: the rest queue up together
            calls = {
                "a0": ledger.record(commit("a", 0)),
                "a1": ledger.record(commit("a", 1)),
                "a0-other": ledger.record(commit("a", 0, output="something else")),
                "a1-again": ledger.record(commit("a", 1)),
                "b0": ledger.record(commit("b", 0)),
                "b0-failed": ledger.record_failure("b", "call-0", "worker_capture_failed"),
            }
            for name, call in calls.items():
                group.start_soon(outcome, results, name, call)
            shard = ledger._committer._shards[0]
            await anyio.to_thread.run_sync(until, lambda: shard._queue.qsize() == len(calls))
            gate.release()
        assert results == {
            "first": "ok",
            "a0": "ok",
            "a1": "ok",
            "a0-other": "conflict",  # only the conflicting caller hears of it
            "a1-again": "ok",  # an identical repeat within the group is a no-op
            "b0": "ok",
            "b0-failed": "ok",
        }
        assert [(r["model_call_id"], "failure_reason" in r) for r in ledger.export_rows("a")] == [
            ("call-0", False),
            ("call-1", False),
        ]
        assert len(ledger.export_rows("b")) == 2
        # One fsync per ledger for the whole group, not one per row.
        assert sorted(gate.synced) == ["a.lineage.jsonl", "b.lineage.jsonl", "first.lineage.jsonl"]
    finally:
        ledger.close()


@pytest.mark.parametrize("how", ["cancel_scope", "task_cancel"])
async def test_a_cancelled_caller_returns_only_after_its_row_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    ledger = FileCaptureLedger(tmp_path)
    gate = FsyncGate(monkeypatch, hold="a.lineage.jsonl")
    ended: list[str] = []
    task: list[asyncio.Task[Any]] = []

    scope = anyio.CancelScope()

    async def record() -> None:
        task.append(asyncio.current_task())  # type: ignore[arg-type]
        with contextlib.suppress(asyncio.CancelledError), scope:  # the bare cancel ends here
            try:
                await ledger.record(commit("a", 0))
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise
            ended.append("returned")

    try:
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as group:
                group.start_soon(record)
                await gate.wait_held()  # the row is written, not yet fsynced
                if how == "cancel_scope":
                    scope.cancel()
                else:
                    task[0].cancel()  # a bare asyncio cancel, outside any anyio scope
                for _ in range(20):
                    await anyio.sleep(0.01)
                assert ended == []  # still waiting for its row, cancelled or not
                assert gate.synced == []
                gate.release()
        # Cancelled at once or at its next checkpoint: either way only after the fsync.
        assert len(ended) == 1
        assert gate.synced == ["a.lineage.jsonl"]
        assert [row["model_call_id"] for row in ledger.export_rows("a")] == ["call-0"]
    finally:
        ledger.close()


@pytest.fixture(params=["file", "memory"])
def any_ledger(
    request: pytest.FixtureRequest, tmp_path: Path
) -> FileCaptureLedger | MemoryCaptureLedger:
    if request.param == "file":
        return FileCaptureLedger(tmp_path, commit_threads=2)
    return MemoryCaptureLedger()


async def test_concurrent_records_of_one_rollout_keep_call_order_and_conflicts(
    any_ledger: FileCaptureLedger | MemoryCaptureLedger,
) -> None:
    results: dict[str, str] = {}
    try:
        async with anyio.create_task_group() as group:
            for turn in range(8):
                group.start_soon(outcome, results, f"r{turn}", any_ledger.record(commit("r", turn)))
            group.start_soon(
                outcome, results, "r3-other", any_ledger.record(commit("r", 3, output="other"))
            )
            group.start_soon(outcome, results, "s0", any_ledger.record(commit("s", 0)))
        assert results.pop("r3-other") == "conflict"
        assert set(results.values()) == {"ok"}
        rows = any_ledger.export_rows("r")
        assert [row["model_call_id"] for row in rows] == [f"call-{turn}" for turn in range(8)]
        assert len(any_ledger.export_rows("s")) == 1
    finally:
        any_ledger.close()


async def test_a_failing_group_reaches_each_of_its_callers_and_the_shard_goes_on() -> None:
    calls: list[int] = []

    def commit_group(group: list[PendingAppend]) -> None:
        calls.append(len(group))
        if len(calls) == 1:
            raise OSError("disk gone")
        for item in group:
            item.settle()

    committer = GroupCommitter(commit_group, shards=1)

    def item() -> PendingAppend:
        row: dict[str, Any] = {"model_call_id": "c", "failure_reason": "x"}
        return PendingAppend("k", row, b"", True, "")

    try:
        with anyio.fail_after(DEADLINE_S), pytest.raises(OSError, match="disk gone"):
            await committer.submit(item(), 0)
        with anyio.fail_after(DEADLINE_S):
            await committer.submit(item(), 0)  # the thread survived the failure
        assert calls == [1, 1]
    finally:
        committer.close()
