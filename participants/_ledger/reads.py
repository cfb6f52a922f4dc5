"""The ledger's blocking reads on threads of their own, woken once per batch (D349).

``manifest``, ``has_rows``, ``resolve`` and ``resolve_explicit`` read the ledger off the event
loop. Here a read is queued on a ``queue.SimpleQueue`` and answered with
``call_soon_threadsafe``, the mechanism of the group commit (D133, D188): on this VM 62 to 104 µs
a round trip against 94 to 123 through ``anyio.to_thread.run_sync``, and with 64 reads in flight
26 µs a read against 224 to 304. A thread takes one read at a time, so one that
blocks (a file-layout read waits for its key's lock behind a writer) leaves the reads queued
behind it to the other threads; but it wakes the callers only once the queue is empty (or a
batch is full), one wake-up per event loop, so thousands of rollouts resolving at once do not pay
one loop wake-up each (D345). A thread is started when more reads are queued than threads wait.

A read changes nothing, so a cancelled caller does not wait for it: its result is dropped. Each
read runs in a copy of its caller's context (the log context goes with it). A thread exits after
``idle_s`` without work and is started again by the next read; at most ``threads`` run.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import structlog

from .group import CLOSE_DEADLINE_SECONDS, IDLE_EXIT_SECONDS, call_each_loop

_log = structlog.get_logger("midflight.ledger")

DEFAULT_READ_THREADS: Final = 2
"""Most threads reading at once. Reads are mostly Python under the GIL: on two cores, 64 reads
in flight cost 26 µs each on one thread, 46 on two and 70 on four; a second thread keeps reads
going while one waits for the disk."""
FILE_LAYOUT_READ_THREADS: Final = 8
"""The file layout's: its reads can wait for a key's lock behind a writer's fsync."""
DEFAULT_MAX_READ_BATCH: Final = 64
"""Most reads one thread takes before it wakes their callers."""

T = TypeVar("T")


class _Empty:
    """What ``ReadPool._take`` returns when no read is queued."""


EMPTY: Final = _Empty()


@dataclass(eq=False, slots=True)
class _Read:
    work: Callable[[], Any]
    context: contextvars.Context
    future: asyncio.Future[Any]  # on the caller's loop
    result: Any = None
    error: BaseException | None = None


def _wake(done: list[_Read]) -> None:
    """Hand finished reads back, one ``call_soon_threadsafe`` per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Read]] = {}
    for read in done:
        by_loop.setdefault(read.future.get_loop(), []).append(read)
    call_each_loop(by_loop, _deliver)


def _deliver(reads: list[_Read]) -> None:
    # On the caller's loop. A cancelled caller's future is done already: its result is dropped.
    for read in reads:
        if read.future.done():
            continue
        if read.error is None:
            read.future.set_result(read.result)
        else:
            read.future.set_exception(read.error)


class ReadPool:
    """Up to ``threads`` threads running blocking reads for callers on any event loop.

    Args:
        threads: Most threads at once.
        max_batch: Most reads a thread takes before it wakes their callers.
        idle_s: A thread exits after this long without work.
        name: The threads' name prefix.
    """

    def __init__(
        self,
        *,
        threads: int = DEFAULT_READ_THREADS,
        max_batch: int = DEFAULT_MAX_READ_BATCH,
        idle_s: float = IDLE_EXIT_SECONDS,
        name: str = "ledger-read",
    ) -> None:
        if threads < 1 or max_batch < 1:
            raise ValueError("threads and max_batch must be at least 1")
        self._max_threads = threads
        self._max_batch = max_batch
        self._idle_s = idle_s
        self._name = name
        self._queue: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._waiting = 0  # threads ready to take a read, not running one
        self._pending = 0  # reads queued and not yet taken
        self._started = 0
        self._closed = False

    @property
    def running(self) -> int:
        """How many threads are alive now."""
        with self._guard:
            return len(self._threads)

    async def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` on a read thread and return what it returned (or raise what it raised).

        Raises:
            RuntimeError: The pool is closed.
        """
        loop = asyncio.get_running_loop()
        read = _Read(work, contextvars.copy_context(), loop.create_future())
        with self._guard:
            if self._closed:
                raise RuntimeError("the capture ledger is closed")
            self._queue.put(read)
            self._pending += 1
            if self._pending > self._waiting and len(self._threads) < self._max_threads:
                self._started += 1
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-{self._started}", daemon=True
                )
                self._threads.add(thread)
                self._waiting += 1  # counted as waiting until it takes its first read
                thread.start()
        result: T = await read.future
        return result

    def _take(self, *, wait: bool) -> _Read | _Empty | None:
        """The next read; ``None`` to stop (closing); ``EMPTY`` when there is none (without
        ``wait``) or none came within ``idle_s`` (the thread has then left the pool). The
        thread counts as waiting when this is called and no longer when it returns."""
        while True:
            try:
                read = self._queue.get(timeout=self._idle_s) if wait else self._queue.get_nowait()
            except queue.Empty:
                with self._guard:  # run() holds the guard, so nothing slips in between
                    if wait and not self._queue.empty():
                        continue
                    self._waiting -= 1
                    if wait:
                        self._threads.discard(threading.current_thread())
                    return EMPTY
            with self._guard:
                # Both counts move together, so run() never sees this read as still queued
                # with no thread free for it (it would then start none).
                self._waiting -= 1
                if read is not None:
                    self._pending -= 1
            return read

    def _serve(self) -> None:
        done: list[_Read] = []
        while True:
            # One read at a time, so a read that blocks (a file-layout lock) leaves the ones
            # queued behind it to the other threads; the wake-ups wait until the queue is empty.
            read = self._take(wait=not done)
            if read is None:
                _wake(done)
                with self._guard:
                    self._threads.discard(threading.current_thread())
                return
            if isinstance(read, _Empty):
                if not done:
                    return  # idle too long: it has left the pool
                _wake(done)
                done = []
            else:
                if not read.future.done():  # a cancelled caller's read is skipped, not run
                    try:
                        read.result = read.context.run(read.work)
                    except BaseException as exc:  # handed to the awaiting caller
                        read.error = exc
                done.append(read)
                if len(done) >= self._max_batch:
                    _wake(done)
                    done = []
            with self._guard:
                self._waiting += 1  # ready for the next read

    def close(self) -> None:
        """Answer what is queued, then stop every thread (each within the close deadline)."""
        with self._guard:
            self._closed = True
            threads = list(self._threads)
            for _ in threads:
                self._queue.put(None)
        for thread in threads:
            thread.join(CLOSE_DEADLINE_SECONDS)
            if thread.is_alive():
                _log.error("ledger_read_thread_stuck", thread=thread.name)
