"""Group commit for the file ledger's appends: queued rows, one worker thread per shard.

``record`` and ``record_failure`` do not each take a trip through a general thread pool. Each
append is queued on the shard of its key's stripe; the shard's thread takes every append
queued at that moment (up to a cap), hands them to the ledger as one group and wakes each
caller once the ledger has settled its row. The ledger settles a row only after the fsync that
made it durable, and a failure is given to the rows it concerns only (see
``FileCaptureLedger._commit_group``).

Sharding by stripe keeps the appends of one key in the order they were queued (one queue, one
thread) while the fsyncs of different shards overlap, as they did on the thread pool: the disk
commits concurrent fsyncs together, so one thread for everything would serialize them. A shard
thread exits after ``idle_s`` without work and is started again by the next append.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import structlog

_log = structlog.get_logger("midflight.ledger")

DEFAULT_COMMIT_THREADS: Final = 16
DEFAULT_MAX_COMMIT_BATCH: Final = 256
IDLE_EXIT_SECONDS: Final = 2.0
CLOSE_DEADLINE_SECONDS: Final = 30.0


@dataclass(eq=False, slots=True)
class PendingAppend:
    """One row on its way into a ledger, and the caller waiting for it.

    Attributes:
        key: The ledger key.
        row: The row as a dict (what the cache keeps).
        line: The row encoded as one ledger line.
        failure: Whether it is a failure row (another reason is another row, not a conflict).
        staging_key: For the late-write warning.
        error: Set by the ledger when this row, and only this row, failed.
    """

    key: str
    row: dict[str, Any]
    line: bytes
    failure: bool
    staging_key: str
    error: BaseException | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _future: asyncio.Future[None] | None = None
    _settled: bool = False
    _woken: bool = False

    def settle(self) -> None:
        """Wake the caller with ``error`` or success. Called once, after the row is durable."""
        if self._settled:
            return
        self._settled = True
        loop = self._loop
        if loop is None:
            return
        # A closed loop (RuntimeError) means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_wake, self)


def _wake(item: PendingAppend) -> None:
    # On the caller's loop, so it cannot race ``submit`` swapping in a new future after a
    # cancellation: whichever future the caller waits on now gets the outcome.
    item._woken = True
    future = item._future
    if future is None or future.done():
        return
    if item.error is None:
        future.set_result(None)
    else:
        future.set_exception(item.error)


def settle_all(items: list[PendingAppend]) -> None:
    """``settle`` every item, waking each caller's loop once for all of its items.

    A wake-up from another thread writes to the loop's self-pipe, and that write lets go of the
    GIL; taking it back waits behind a busy loop for up to the switch interval. One wake-up per
    row made a group of 64 rows wait for 64 of them (D345).
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[PendingAppend]] = {}
    for item in items:
        if item._settled:
            continue
        item._settled = True
        if item._loop is not None:
            by_loop.setdefault(item._loop, []).append(item)
    call_each_loop(by_loop, _wake_each)


def call_each_loop(
    by_loop: dict[asyncio.AbstractEventLoop, list[Any]], callback: Callable[[list[Any]], None]
) -> None:
    """From another thread, run ``callback(items)`` on each loop once, with that loop's items."""
    for loop, items in by_loop.items():
        # A closed loop (RuntimeError) means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, items)


def _wake_each(items: list[PendingAppend]) -> None:
    for item in items:
        _wake(item)


CommitGroup = Callable[[list[PendingAppend]], None]
"""Commits a group of appends and settles each one (``FileCaptureLedger._commit_group``)."""


class _Shard:
    """One queue and the thread that drains it in groups."""

    def __init__(self, name: str, commit: CommitGroup, max_batch: int, idle_s: float) -> None:
        self._name = name
        self._commit = commit
        self._max_batch = max_batch
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[PendingAppend | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, item: PendingAppend) -> None:
        with self._guard:
            if self._closed:
                raise RuntimeError("the capture ledger is closed")
            self._queue.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _next_group(self) -> tuple[list[PendingAppend], bool] | None:
        """The next group and whether close was asked; ``None`` when idle too long."""
        try:
            first = self._queue.get(timeout=self._idle_s)
        except queue.Empty:
            with self._guard:  # put() holds the guard, so nothing slips in between
                if self._queue.empty():
                    self._thread = None
                    return None
            return [], False
        if first is None:
            return [], True
        group = [first]
        while len(group) < self._max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return group, True
            group.append(item)
        return group, False

    def _run(self) -> None:
        while True:
            taken = self._next_group()
            if taken is None:
                return
            group, stop = taken
            if group:
                try:
                    self._commit(group)
                except BaseException as exc:  # a bug, not a row's fault: nobody may hang
                    _log.error("ledger_group_commit_failed", error=repr(exc), rows=len(group))
                    for item in group:
                        if item.error is None:
                            item.error = exc
                        item.settle()
            if stop:
                return

    def close(self) -> None:
        with self._guard:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(CLOSE_DEADLINE_SECONDS)
            if thread.is_alive():
                _log.error("ledger_commit_thread_stuck", thread=self._name)


class GroupCommitter:
    """Shards of queued appends, each drained by its own thread.

    Args:
        commit: Commits one group and settles each of its appends.
        shards: How many queues and threads; a key's shard is its stripe modulo this.
        max_batch: Most appends handed over in one group.
        idle_s: A shard thread exits after this long without work.
    """

    def __init__(
        self,
        commit: CommitGroup,
        *,
        shards: int = DEFAULT_COMMIT_THREADS,
        max_batch: int = DEFAULT_MAX_COMMIT_BATCH,
        idle_s: float = IDLE_EXIT_SECONDS,
    ) -> None:
        if shards < 1 or max_batch < 1:
            raise ValueError("shards and max_batch must be at least 1")
        self._shards = [
            _Shard(f"ledger-commit-{index}", commit, max_batch, idle_s) for index in range(shards)
        ]

    @property
    def shards(self) -> int:
        """How many shards (and at most how many threads)."""
        return len(self._shards)

    async def submit(self, item: PendingAppend, stripe: int) -> None:
        """Queue ``item`` on the shard of ``stripe`` and wait until it is settled.

        Raises:
            BaseException: ``item.error``, when the ledger refused or failed this row.
        """
        loop = asyncio.get_running_loop()
        item._loop = loop
        item._future = future = loop.create_future()
        self._shards[stripe % len(self._shards)].put(item)
        try:
            # Awaited bare: a shielding cancel scope around every wait cost about 20 µs per
            # row (D186); the rare cancellation pays for its shield below instead.
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.exception()  # the outcome lost the race to the cancel: mark it seen
            if not item._woken:
                # Like a worker-thread call, a cancelled caller still waits for its row, so
                # nothing it queued lands after it has moved on (a delete right after must
                # not be undone).
                item._future = again = loop.create_future()
                with anyio.CancelScope(shield=True):
                    await again
            raise

    def close(self) -> None:
        """Commit what is queued, then stop every shard thread."""
        for shard in self._shards:
            shard.close()
