"""The loop watch of every reference server process (D406): a held event loop is logged with
the stack that held it, and counted on ``/metrics``."""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from e2e._launch.loop_watch import METRIC_NAMES, GcClock, LoopWatch, run_watched, stack_of
from e2e._launch.spawn import ServerProcess

pytestmark = pytest.mark.anyio


def _hold_the_loop(seconds: float) -> None:
    """Block the calling thread (the event loop's) the way a blocking call would."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)  # releases the GIL, as a blocking system call does


def _fast(registry: CollectorRegistry | None = None, **overrides: float) -> LoopWatch:
    settings: dict[str, Any] = {"stall_s": 0.5, "tick_s": 0.05, "sample_s": 0.05} | overrides
    return LoopWatch(registry=registry, process="test", **settings)


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


async def test_a_held_loop_is_logged_once_with_the_stack_that_held_it() -> None:
    registry = CollectorRegistry()
    with capture_logs() as logs:
        async with _fast(registry).watching():
            await anyio.sleep(0.3)
            _hold_the_loop(1.5)
            await anyio.sleep(0.3)
    (stall,) = _events(logs, "event_loop_stalled")
    assert 1.2 <= stall["stalled_s"] < 5, stall
    assert stall["process"] == "test" and stall["log_level"] == "warning"
    assert stall["samples"] >= 5, stall
    top = stall["stacks"][0]
    assert top["samples"] >= 5
    assert any(frame.endswith(" _hold_the_loop") for frame in top["frames"]), top
    assert any(f"{__name__}:" in frame for frame in top["frames"]), top
    assert registry.get_sample_value("midflight_event_loop_stalls_total") == 1
    stalled = registry.get_sample_value("midflight_event_loop_stalled_seconds_total")
    assert stalled is not None and stalled >= 1.2
    lags = registry.get_sample_value("midflight_event_loop_lag_seconds_count")
    assert lags is not None and lags >= 5  # every beat is observed, the stalled one among them
    late = registry.get_sample_value("midflight_event_loop_lag_seconds_bucket", {"le": "1.0"})
    assert late is not None and late == lags - 1  # exactly one beat came more than 1 s late


def _cyclic_garbage(count: int) -> None:
    """Leave ``count`` lists behind, each referring to itself: only a collection frees them."""
    for _ in range(count):
        cycle: list[Any] = []
        cycle.append(cycle)


def test_the_collector_s_clock_can_be_cpu_time_rather_than_the_wall_s() -> None:
    """``bench hotpath`` reads collections in the collecting thread's CPU time (D427), so a
    collection that waited for a core under load is not counted as CPU it never took."""
    import gc

    ticks = iter(range(0, 1000, 5))
    with GcClock(clock=lambda: float(next(ticks))) as clock:
        gc.collect()
        gc.collect()
    assert clock.collections == 2
    assert clock.seconds == 10.0  # two collections, 5 of the given clock's units each


async def test_a_stall_says_how_much_of_it_the_garbage_collector_took() -> None:
    """D411: a collection holds the GIL, so no stack shows it; the event says it instead."""
    registry = CollectorRegistry()
    with capture_logs() as logs:
        async with _fast(registry).watching():
            await anyio.sleep(0.2)
            gc.disable()  # this collection, and only this one, inside the stall
            try:
                _cyclic_garbage(300_000)
                start = time.perf_counter()
                gc.collect()
                collected_s = time.perf_counter() - start
            finally:
                gc.enable()
            _hold_the_loop(0.6)
            await anyio.sleep(0.2)
    (stall,) = _events(logs, "event_loop_stalled")
    assert stall["gc_collections"] >= 1, stall
    assert collected_s * 0.9 <= stall["gc_s"] <= stall["stalled_s"], (collected_s, stall)
    full = registry.get_sample_value("midflight_gc_pause_seconds_count", {"generation": "2"})
    assert full is not None and full >= 1
    held = registry.get_sample_value("midflight_gc_pause_seconds_sum", {"generation": "2"})
    assert held is not None and held >= collected_s * 0.9


async def test_a_stall_without_collections_says_so() -> None:
    gc.collect()
    with capture_logs() as logs:
        async with _fast().watching():
            await anyio.sleep(0.2)
            gc.disable()
            try:
                _hold_the_loop(0.8)
            finally:
                gc.enable()
            await anyio.sleep(0.2)
    (stall,) = _events(logs, "event_loop_stalled")
    assert stall["gc_collections"] == 0 and stall["gc_s"] == 0, stall


async def test_the_operations_page_shows_the_stall_event_with_its_real_fields() -> None:
    page = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    example = json.loads(page.split("```json\n", 1)[1].split("```", 1)[0])
    with capture_logs() as logs:
        async with _fast().watching():
            await anyio.sleep(0.1)
            _hold_the_loop(0.8)
            await anyio.sleep(0.2)
    (stall,) = _events(logs, "event_loop_stalled")
    # capture_logs names the level log_level; a server's JSON log says level, with a timestamp.
    logged = {"level", "timestamp"} | set(stall) - {"log_level"}
    assert set(example) == logged
    assert set(example["stacks"][0]) == set(stall["stacks"][0])


async def test_run_watched_watches_the_work_it_runs() -> None:
    """D410: the drill's controller runs under a watch of its own, its stalls in its log."""
    finished: list[bool] = []

    async def work() -> None:
        await anyio.sleep(0.3)
        _hold_the_loop(1.5)
        await anyio.sleep(0.3)
        finished.append(True)

    with capture_logs() as logs:
        await run_watched(work, "controller")
    assert finished == [True]
    (stall,) = _events(logs, "event_loop_stalled")
    assert stall["process"] == "controller" and stall["stalled_s"] >= 1.2
    assert any(f.endswith(" work") for f in stall["stacks"][0]["frames"]), stall


async def test_a_loop_that_keeps_turning_is_never_called_stalled() -> None:
    registry = CollectorRegistry()
    with capture_logs() as logs:
        async with _fast(registry).watching():
            for _ in range(20):  # busy, but yielding every 0.1 s
                _hold_the_loop(0.1)
                await anyio.lowlevel.checkpoint()
    assert not _events(logs, "event_loop_stalled")
    assert not _events(logs, "event_loop_still_stalled")
    assert registry.get_sample_value("midflight_event_loop_stalls_total") == 0


async def test_a_stall_that_goes_on_is_logged_while_it_lasts() -> None:
    with capture_logs() as logs:
        async with _fast(ongoing_s=0.6).watching():
            await anyio.sleep(0.2)
            _hold_the_loop(1.6)
            # Said before the loop turned again: a process killed now has said where it was.
            ongoing = _events(logs, "event_loop_still_stalled")
            await anyio.sleep(0.2)
    assert 1 <= len(ongoing) <= 3, ongoing
    assert ongoing[0]["stalled_s"] >= 0.6
    assert any(f.endswith(" _hold_the_loop") for f in ongoing[0]["stacks"][0]["frames"])
    assert len(_events(logs, "event_loop_stalled")) == 1


def test_a_stack_names_modules_lines_and_functions_innermost_first() -> None:
    def inner() -> tuple[str, ...]:
        return stack_of(sys._getframe(), depth=2)

    frames = inner()
    assert frames[0].startswith(f"{__name__}:") and frames[0].endswith(" inner")
    assert frames[1].endswith(" test_a_stack_names_modules_lines_and_functions_innermost_first")
    assert len(frames) == 2


def test_a_watch_needs_a_tick_shorter_than_a_stall() -> None:
    with pytest.raises(ValueError, match="tick_s < stall_s"):
        LoopWatch(stall_s=0.1, tick_s=0.1)


def _lag_count(text: str) -> float:
    (count,) = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("midflight_event_loop_lag_seconds_count")
    ]
    return count


@pytest.mark.process
def test_a_real_server_process_shows_its_loop_on_metrics(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "e2e", "serve", "resources", "--port", "0"]
    argv += ["--root", str(tmp_path / "run")]
    with ServerProcess(argv, env={}, log_path=tmp_path / "resources.log") as server:
        deadline = time.monotonic() + 30
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for name in METRIC_NAMES:
            assert f"# TYPE {name} " in text, name
        while _lag_count(text) < 3 and time.monotonic() < deadline:  # the beats are counted
            time.sleep(0.1)
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert _lag_count(text) >= 3
