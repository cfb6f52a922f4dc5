"""Noticing when a server's event loop stops turning, and saying where it was (D406).

A server with thousands of rollouts in flight does all of its work on one event loop. When that
loop is held, by a call that blocks or by more ready work than a turn can get through, every
request of every rollout waits, and what the clients later see is a deadline that ran out
("did not answer within 60 s") with nothing to say why. A :class:`LoopWatch` runs beside the loop:

- a task on the loop wakes every ``TICK_S`` and notes the time (the *beat*); how late each wake-up
  came is ``midflight_event_loop_lag_seconds``;
- a thread of its own looks every ``SAMPLE_S``. When the beat is older than ``STALL_S`` the loop
  is stalled, and the thread records the stack the loop's thread is running at that moment;
- when the loop turns again, the task logs one ``event_loop_stalled`` event: how long, how many
  stacks were sampled, and the most frequent ones, innermost frame first. A stall that goes on
  is also logged while it lasts (``event_loop_still_stalled``, every ``ONGOING_S``), so a process
  killed during a stall has said where it was.

The watch also times every collection of the cyclic garbage collector in its process
(``gc.callbacks``, :class:`GcClock`). A collection holds the GIL from start to end, so no stack
is sampled inside one; instead each stall's event says how much of it went into collections
(``gc_s``, ``gc_collections``), and ``midflight_gc_pause_seconds`` shows each collection by
generation (D411).

A stack is sampled with ``sys._current_frames()``, which needs the GIL: a C call that holds it
for a long time (a big ``sorted``, one huge validation) is seen only once it has returned, so the
sample names the code that ran next. Frame names and line numbers are logged, never a frame's
values, so no token or request body reaches the log.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

TICK_S: Final = 0.1
"""How often the loop's task notes that the loop turned."""
STALL_S: Final = 1.0
"""A loop that has not turned for this long is stalled."""
SAMPLE_S: Final = 0.25
"""How often the watching thread looks at the beat (and, during a stall, samples a stack)."""
ONGOING_S: Final = 10.0
"""A stall is logged while it lasts, this often."""
STACK_DEPTH: Final = 8
"""Innermost frames kept of each sampled stack."""
TOP_STACKS: Final = 3
"""Stacks named in a stall's event, the most frequent first."""
LAG_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GC_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
JOIN_S: Final = 2.0
"""How long leaving the watch waits for its thread."""

LAG_METRIC: Final = "midflight_event_loop_lag_seconds"
STALLS_METRIC: Final = "midflight_event_loop_stalls"
STALLED_METRIC: Final = "midflight_event_loop_stalled_seconds"
GC_METRIC: Final = "midflight_gc_pause_seconds"
METRIC_NAMES: Final = (LAG_METRIC, f"{STALLS_METRIC}_total", f"{STALLED_METRIC}_total", GC_METRIC)
"""The families a watched process adds to its ``/metrics`` (as ``# TYPE`` names them)."""

_log = structlog.get_logger("midflight.loop")


def _frame_name(frame: FrameType) -> str:
    """``module:line function``, e.g. ``participants._ledger.sqlite:250 _commit_group``."""
    module = frame.f_globals.get("__name__", "?")
    return f"{module}:{frame.f_lineno} {frame.f_code.co_name}"


def stack_of(frame: FrameType | None, depth: int = STACK_DEPTH) -> tuple[str, ...]:
    """The innermost ``depth`` frames from ``frame`` outwards, each named by ``_frame_name``."""
    names: list[str] = []
    while frame is not None and len(names) < depth:
        names.append(_frame_name(frame))
        frame = frame.f_back
    return tuple(names)


class GcClock:
    """Times each collection of the cyclic garbage collector while it is entered (D411).

    ``seconds`` and ``collections`` only grow, so a reader takes their difference over a span.
    Collections never overlap (the collector holds the GIL and does not start inside one), so
    one start time is enough.

    Args:
        pauses: Observes each collection's seconds, labelled by ``generation``; none when omitted.
        clock: What a collection's seconds are read from: wall-clock time by default (how long
            it held the process), ``time.thread_time`` for the CPU it took (a collection runs
            on one thread from start to end), as ``bench hotpath`` counts it (D427).
    """

    def __init__(
        self, pauses: Histogram | None = None, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0
        self._clock = clock
        self._pauses = None if pauses is None else [pauses.labels(str(g)) for g in range(3)]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = self._clock()
        if phase == "start":
            self._started = now
            return
        took = now - self._started
        self.seconds += took
        self.collections += 1
        if self._pauses is not None:
            self._pauses[min(info["generation"], 2)].observe(took)

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


@dataclass
class _Stall:
    beat: float
    """The last beat before the loop stopped turning."""
    stacks: Tally[tuple[str, ...]] = field(default_factory=Tally)
    next_report: float = ONGOING_S

    def summary(self) -> list[dict[str, Any]]:
        return [
            {"samples": count, "frames": list(frames)}
            for frames, count in self.stacks.most_common(TOP_STACKS)
        ]


class LoopWatch:
    """Watches the event loop it is entered on; see the module docstring.

    Args:
        registry: Where the metrics go (the server's ``/metrics``); none when omitted.
        process: Names the process in every event (``main``, ``shard-1``, ...).
        stall_s: How long the loop must not turn to count as stalled.
        tick_s: How often the loop's task notes a beat.
        sample_s: How often the watching thread looks.
        ongoing_s: How often a stall that goes on is logged while it lasts.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        process: str = "main",
        stall_s: float = STALL_S,
        tick_s: float = TICK_S,
        sample_s: float = SAMPLE_S,
        ongoing_s: float = ONGOING_S,
    ) -> None:
        if not 0 < tick_s < stall_s or sample_s <= 0 or ongoing_s <= 0:
            raise ValueError("need 0 < tick_s < stall_s, and sample_s and ongoing_s above 0")
        self._stall_s = stall_s
        self._tick_s = tick_s
        self._sample_s = sample_s
        self._ongoing_s = ongoing_s
        self._log = _log.bind(process=process)
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._stall: _Stall | None = None
        self._loop_thread = 0
        self._gc_mark = (0.0, 0)
        """The collector's seconds and collections at the last beat."""
        self.lag = Histogram(
            LAG_METRIC,
            "How late the event loop's watch task woke, each time it woke (0.1 s apart).",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.stalls = Counter(
            STALLS_METRIC,
            "Times the event loop did not turn for a second or more.",
            registry=registry,
        )
        self.stalled = Counter(
            STALLED_METRIC,
            "Seconds the event loop spent stalled, summed over its stalls.",
            registry=registry,
        )
        self.gc = GcClock(
            Histogram(
                GC_METRIC,
                "Seconds each collection of the cyclic garbage collector held the process.",
                ["generation"],
                buckets=GC_BUCKETS,
                registry=registry,
            )
        )

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Watch the running loop until the block is left."""
        self._loop_thread = threading.get_ident()
        with self._lock:
            self._beat = time.monotonic()
            self._stall = None
            self._gc_mark = (self.gc.seconds, self.gc.collections)
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(stop,), name="loop-watch", daemon=True)
        thread.start()
        try:
            with self.gc:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._tick)
                    try:
                        yield
                    finally:
                        group.cancel_scope.cancel()
        finally:
            stop.set()
            thread.join(JOIN_S)

    async def _tick(self) -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(self._tick_s)
            now = time.monotonic()
            late = max(0.0, now - before - self._tick_s)
            with self._lock:
                self._beat = now
                stall, self._stall = self._stall, None
                gc_before, collections_before = self._gc_mark
                self._gc_mark = (self.gc.seconds, self.gc.collections)
            self.lag.observe(late)
            if late >= self._stall_s:
                self.stalls.inc()
                self.stalled.inc(late)
                samples = 0 if stall is None else sum(stall.stacks.values())
                self._log.warning(
                    "event_loop_stalled",
                    stalled_s=round(late, 3),
                    gc_s=round(self.gc.seconds - gc_before, 3),
                    gc_collections=self.gc.collections - collections_before,
                    samples=samples,
                    stacks=[] if stall is None else stall.summary(),
                )

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(self._sample_s):
            with self._lock:
                beat, (gc_before, _) = self._beat, self._gc_mark
            quiet = time.monotonic() - beat
            if quiet < self._stall_s:
                continue
            stack = stack_of(sys._current_frames().get(self._loop_thread))
            summary: list[dict[str, Any]] = []
            with self._lock:
                if self._beat != beat:
                    continue  # it turned while the stack was read: this sample is of no stall
                if self._stall is None or self._stall.beat != beat:
                    self._stall = _Stall(beat=beat, next_report=self._ongoing_s)
                stall = self._stall
                stall.stacks[stack] += 1
                samples = sum(stall.stacks.values())
                report = quiet >= stall.next_report
                if report:
                    stall.next_report += self._ongoing_s
                    summary = stall.summary()
            if report:
                self._log.warning(
                    "event_loop_still_stalled",
                    stalled_s=round(quiet, 3),
                    gc_s=round(self.gc.seconds - gc_before, 3),
                    samples=samples,
                    stacks=summary,
                )


async def run_watched(work: Callable[[], Awaitable[None]], process: str) -> None:
    """``await work()`` with a :class:`LoopWatch` on the loop, its metrics in no registry: for a
    process with no ``/metrics``, such as the drill's controller (D410)."""
    async with LoopWatch(process=process).watching():
        await work()


__all__ = ["METRIC_NAMES", "GcClock", "LoopWatch", "run_watched", "stack_of"]
