"""The ledger's read pool: off the loop, one wake-up per batch, cancellation, idle exit, close."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from participants import SqliteCaptureLedger
from participants._ledger import reads
from participants._ledger.reads import ReadPool

from .ledger_factory import commit
from .test_ledger_group import until

pytestmark = pytest.mark.anyio

DEADLINE_S = 10.0
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="none")


class Gate:
    """A read that blocks its thread until released, and says when it has started."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self._open = threading.Event()

    def work(self) -> str:
        self.started.set()
        assert self._open.wait(DEADLINE_S), "the gate was never opened"
        return "gated"

    async def wait_started(self) -> None:
        assert await anyio.to_thread.run_sync(self.started.wait, DEADLINE_S), "never started"

    def release(self) -> None:
        self._open.set()


async def test_a_read_runs_off_the_loop_in_a_copy_of_the_callers_context() -> None:
    pool = ReadPool()
    _caller.set("the request's")
    try:
        ident, value = await pool.run(lambda: (threading.get_ident(), _caller.get()))
    finally:
        pool.close()
    assert ident != threading.get_ident()
    assert value == "the request's"


async def test_what_a_read_raises_reaches_its_caller() -> None:
    pool = ReadPool()

    def fails() -> None:
        raise KeyError("rollout-1")

    try:
        with pytest.raises(KeyError, match="rollout-1"):
            await pool.run(fails)
        assert await pool.run(lambda: 7) == 7  # the thread survived it
    finally:
        pool.close()


async def test_reads_queued_together_wake_their_loop_once(monkeypatch: pytest.MonkeyPatch) -> None:
    wakes: list[int] = []
    deliver = reads._deliver

    def counted(batch: list[Any]) -> None:
        wakes.append(len(batch))
        deliver(batch)

    monkeypatch.setattr(reads, "_deliver", counted)
    pool = ReadPool(threads=1)
    gate = Gate()
    results: list[int] = []

    async def read(value: int) -> None:
        results.append(await pool.run(lambda: value))

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pool.run, gate.work)
            await gate.wait_started()
            for value in range(50):  # queued behind the gate, all at once
                group.start_soon(read, value)
            await anyio.to_thread.run_sync(until, lambda: pool._queue.qsize() == 50)
            gate.release()
    finally:
        pool.close()
    assert sorted(results) == list(range(50))
    assert wakes == [51]  # the gate's read and the fifty queued behind it: one wake-up


async def test_a_cancelled_caller_leaves_at_once_and_its_read_never_runs() -> None:
    pool = ReadPool(threads=1)
    gate = Gate()
    ran = threading.Event()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(pool.run, gate.work)
            await gate.wait_started()
            start = time.monotonic()
            with anyio.move_on_after(0.05):
                await pool.run(ran.set)
            assert time.monotonic() - start < DEADLINE_S / 2  # it did not wait for the gate
            gate.release()
        assert await pool.run(lambda: "after") == "after"
    finally:
        pool.close()
    assert not ran.is_set()


async def test_a_second_thread_starts_while_the_first_is_busy() -> None:
    pool = ReadPool(threads=2)
    meet = threading.Barrier(2, timeout=DEADLINE_S)
    try:
        async with anyio.create_task_group() as group:  # both wait for the other: two threads
            group.start_soon(pool.run, meet.wait)
            group.start_soon(pool.run, meet.wait)
        assert pool.running == 2
    finally:
        pool.close()
    assert pool.running == 0


async def test_no_more_than_threads_run_at_once() -> None:
    pool = ReadPool(threads=2)
    gates = [Gate(), Gate(), Gate()]
    try:
        async with anyio.create_task_group() as group:
            for gate in gates:
                group.start_soon(pool.run, gate.work)
            await gates[0].wait_started()
            await gates[1].wait_started()
            assert pool.running == 2
            assert not gates[2].started.wait(0.1)  # queued: no third thread
            gates[0].release()
            await gates[2].wait_started()
            gates[1].release()
            gates[2].release()
    finally:
        pool.close()


async def test_an_idle_thread_exits_and_the_next_read_starts_one() -> None:
    pool = ReadPool(idle_s=0.05)
    try:
        assert await pool.run(lambda: 1) == 1
        await anyio.to_thread.run_sync(until, lambda: pool.running == 0)
        assert await pool.run(lambda: 2) == 2
    finally:
        pool.close()


async def test_close_answers_what_is_queued_then_refuses_new_reads() -> None:
    pool = ReadPool(threads=1)
    gate = Gate()
    results: list[str] = []

    async def read(work: Callable[[], str]) -> None:
        results.append(await pool.run(work))

    async with anyio.create_task_group() as group:
        group.start_soon(read, gate.work)
        await gate.wait_started()
        group.start_soon(read, lambda: "queued")
        await anyio.to_thread.run_sync(until, lambda: pool._queue.qsize() == 1)
        closing = threading.Thread(target=pool.close)
        closing.start()
        await anyio.to_thread.run_sync(until, lambda: pool._closed)
        gate.release()
    await anyio.to_thread.run_sync(closing.join, DEADLINE_S)
    assert results == ["gated", "queued"]
    assert pool.running == 0
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(lambda: "late")


def test_one_pool_serves_callers_on_different_loops() -> None:
    pool = ReadPool()
    try:
        assert anyio.run(pool.run, lambda: "first loop") == "first loop"
        assert anyio.run(pool.run, lambda: "second loop") == "second loop"
    finally:
        pool.close()


async def test_a_ledgers_reads_go_through_its_pool(tmp_path: Path) -> None:
    ledger = SqliteCaptureLedger(tmp_path / "ledger")
    try:
        await ledger.record(commit("rollout-1", 0))
        assert ledger._reads.running == 0
        manifest = await ledger.manifest("rollout-1")
        assert [entry.model_call_id for entry in manifest.records] == ["call-0"]
        assert ledger._reads.running == 1
        assert await ledger.has_rows("rollout-1")
    finally:
        ledger.close()
    assert ledger._reads.running == 0
