"""The ledger benchmark's parts: the floors do their work where the figures say they do."""

from __future__ import annotations

import os
import threading
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from e2e._bench.ledger import _Floor, _LogFloor, _ThreadHop
from e2e._bench.ledger_floors import wake_probe
from e2e._servers.model import open_capture_ledger

pytestmark = pytest.mark.anyio


async def test_the_thread_hop_runs_the_work_off_the_event_loop_and_waits_for_it() -> None:
    ran_on: list[int] = []
    with _ThreadHop() as hop, anyio.fail_after(10):
        await hop.run(lambda: ran_on.append(threading.get_ident()))
        assert ran_on and ran_on[0] != threading.get_ident()  # the round trip really happens

        def fail() -> None:
            raise OSError("disk gone")

        with pytest.raises(OSError, match="disk gone"):
            await hop.run(fail)
        await hop.run(lambda: ran_on.append(threading.get_ident()))  # the thread survived
        assert len(ran_on) == 2


async def test_the_floor_via_the_thread_writes_what_the_bare_floor_writes(tmp_path: Path) -> None:
    bare, via = _Floor(tmp_path / "bare"), _Floor(tmp_path / "via")
    lines = [b'{"a":1}\n', b'{"a":2}\n']
    try:
        bare.record({"k": lines})
        with _ThreadHop() as hop, anyio.fail_after(10):
            for index, line in enumerate(lines):
                await hop.run(partial(via.record_row, "k", line, first=index == 0))
    finally:
        bare.close()
        via.close()
    names = sorted(os.listdir(tmp_path / "bare"))
    assert names == ["k.lineage.jsonl"] == sorted(os.listdir(tmp_path / "via"))
    assert (tmp_path / "via" / names[0]).read_bytes() == b"".join(lines)
    assert (tmp_path / "bare" / names[0]).read_bytes() == b"".join(lines)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placement needs two CPUs")
def test_the_wake_probe_pins_its_threads_where_it_says_and_leaves_the_caller_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = os.sched_getaffinity(0)
    pinned: list[tuple[str, set[int]]] = []
    real = os.sched_setaffinity

    def recording(pid: int, cpus: set[int]) -> None:
        pinned.append((threading.current_thread().name, set(cpus)))
        real(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", recording)
    found = wake_probe(rounds=20)
    assert found is not None and found["same_cpu_us"] > 0 and found["other_cpu_us"] > 0
    first, second = sorted(before)[:2]
    # The probe's loop on the first CPU; one hop thread beside it, then one on the second.
    assert [cpus for _name, cpus in pinned] == [{first}, {first}, {second}]
    assert pinned[0][0] == "bench-wake-probe"
    assert {name for name, _cpus in pinned[1:]} == {"bench-hop"}
    assert os.sched_getaffinity(0) == before  # the caller's thread was never pinned


def test_the_wake_probe_says_nothing_where_a_thread_cannot_be_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert wake_probe(rounds=5) is None  # one CPU: no second placement to compare


@pytest.mark.parametrize("layout", ["sqlite", "file"])
async def test_the_hot_path_bench_captures_every_call_with_fsync_stubbed_only_inside(
    tmp_path: Path, layout: str
) -> None:
    from e2e._bench.hotpath import fsync_stubbed, run_hotpath_bench

    real = os.fsync
    with fsync_stubbed():
        assert os.fsync is not real
    assert os.fsync is real
    payload = await anyio.to_thread.run_sync(
        partial(run_hotpath_bench, tmp_path, rollouts=2, calls=3, layout=layout)
    )
    assert os.fsync is real
    assert payload["calls"] == 6
    # The steps really ran the server's capture: one custody row per call, chained.
    assert payload["layout"] == layout
    ledger = open_capture_ledger(tmp_path / "ledger", layout)
    try:
        stored = {key: ledger.export_rows(key) for key in ("rollout-0", "rollout-1")}
    finally:
        ledger.close()
    for rows in stored.values():
        assert [row["mode"] for row in rows] == ["text", "token_in", "token_in"]
        assert [row["parent_call_id"] for row in rows[1:]] == [
            rows[0]["model_call_id"],
            rows[1]["model_call_id"],
        ]


async def test_the_hot_path_bench_takes_a_wave_s_calls_through_each_step_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``in_flight`` N, every resolve and every record of a wave's calls is under way at
    the same time (D427), and every call is still captured, chained to its parent."""
    import e2e._bench.hotpath as hotpath

    at_once = {"resolve": 0, "record": 0}
    most = dict.fromkeys(at_once, 0)

    def counted(step: str, real: Any) -> Any:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            at_once[step] += 1
            most[step] = max(most[step], at_once[step])
            try:
                await anyio.lowlevel.checkpoint()  # a wave run one by one would show here
                return await real(*args, **kwargs)
            finally:
                at_once[step] -= 1

        return wrapper

    monkeypatch.setattr(hotpath, "resolve_admission", counted("resolve", hotpath.resolve_admission))
    monkeypatch.setattr(hotpath, "record_custody", counted("record", hotpath.record_custody))
    payload = await anyio.to_thread.run_sync(
        partial(hotpath.run_hotpath_bench, tmp_path, rollouts=5, calls=2, in_flight=4)
    )
    assert most == {"resolve": 4, "record": 4}
    assert payload["in_flight"] == 4
    assert payload["calls"] == 10
    assert payload["floor_cpu_us_per_call"] > 0
    ledger = open_capture_ledger(tmp_path / "ledger", "sqlite")
    try:
        stored = [ledger.export_rows(f"rollout-{index}") for index in range(5)]
    finally:
        ledger.close()
    for rows in stored:  # the last wave holds one rollout
        assert [row["mode"] for row in rows] == ["text", "token_in"]
        assert rows[1]["parent_call_id"] == rows[0]["model_call_id"]
    with pytest.raises(ValueError, match="positive"):
        hotpath.run_hotpath_bench(tmp_path / "none", rollouts=1, in_flight=0)


def test_the_hot_path_bench_says_what_the_collector_took_inside_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    import e2e._bench.hotpath as hotpath

    real = hotpath._admit

    async def admit_and_collect(participant: Any, call: Any) -> None:
        await real(participant, call)
        gc.collect()  # a full collection inside a step, once per call

    monkeypatch.setattr(hotpath, "_admit", admit_and_collect)
    payload = hotpath.run_hotpath_bench(tmp_path, rollouts=3, calls=2, in_flight=2)
    assert payload["gc_collections"] >= 6
    assert 0 < payload["gc_us_per_call"] <= payload["cpu_us_per_call"]


def test_the_hot_path_bench_s_tool_outputs_grow_the_conversation_every_call_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import e2e._bench.hotpath as hotpath

    sizes: list[int] = []
    real = hotpath.conversation_digest

    def measured(items: Any) -> str:
        sizes.append(sum(len(item.content) for item in items))
        return real(items)

    monkeypatch.setattr(hotpath, "conversation_digest", measured)
    payload = hotpath.run_hotpath_bench(tmp_path, rollouts=1, calls=3, tool_bytes=500)
    assert payload["tool_bytes"] == 500
    assert sizes[1] - sizes[0] > 500 and sizes[2] - sizes[1] > 500  # a tool output a call


def test_the_sqlite_layouts_floor_appends_every_byte_to_one_log_and_reads_a_key_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real(fd))[1])
    floor = _LogFloor(tmp_path)
    reads: list[bytes] = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda *a: (reads.append(real_pread(*a)), reads[-1])[1])
    try:
        syncs.clear()
        floor.record({"a": [b"a0\n", b"a1\n"], "b": [b"b0\n"]})
        assert len(syncs) == 3  # one commit per row
        floor.record_concurrent({"c": [b"c0\n", b"c1\n"], "d": [b"d0\n", b"d1\n"]})
        assert len(syncs) == 5  # one commit per turn of the rollouts in flight
        floor.retire([["a", "b"]])
        floor.import_rows_many([{"e": b"e0\ne1\n"}])
        assert len(syncs) == 7  # one per batch
        floor.manifest(["a"])
    finally:
        floor.close()
    log = (tmp_path / "floor.log").read_bytes()
    assert log == b"a0\na1\nb0\nc0\nd0\nc1\nd1\nR a\nR b\ne0\ne1\n"
    assert reads == [b"a0\na1\n"]  # a manifest reads exactly the key's bytes
