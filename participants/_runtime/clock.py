"""Time for the control plane, injectable so that lease and deadline tests are exact.

Deadlines on the wire are absolute Unix epoch seconds, so a clock's ``time`` is wall-clock time.
``ManualClock`` only moves when a test calls ``advance``; everything that waits on it wakes then.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio

from protocols import DeadlineExceededError

T = TypeVar("T")


class Clock(Protocol):
    """Where the control plane reads the time and waits for it to pass."""

    def time(self) -> float:
        """Seconds since the Unix epoch."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``time()`` has reached ``deadline``."""
        ...


class SystemClock:
    """The wall clock."""

    def time(self) -> float:
        """Seconds since the Unix epoch."""
        return time.time()

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until the wall clock reaches ``deadline``."""
        # anyio sleeps on the monotonic clock; re-check the wall clock in case the two drift.
        while (remaining := deadline - time.time()) > 0:  # noqa: ASYNC110
            await anyio.sleep(remaining)


class ManualClock:
    """A clock that moves only when told to; for tests.

    Args:
        start: The initial time, in epoch seconds.
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, anyio.Event]] = []

    def time(self) -> float:
        """The current manual time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has come."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._now += seconds
        due = [event for deadline, event in self._sleepers if deadline <= self._now]
        self._sleepers = [(d, e) for d, e in self._sleepers if d > self._now]
        for event in due:
            event.set()

    async def sleep_until(self, deadline: float) -> None:
        """Wait until ``advance`` has moved time to ``deadline``."""
        if deadline <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        self._sleepers.append((deadline, event))
        await event.wait()


async def wait_until(clock: Clock, deadline: float, wait: Callable[[], Awaitable[object]]) -> bool:
    """Await ``wait()`` until it returns or the clock reaches ``deadline``.

    Returns:
        True when ``wait()`` returned first, False when the deadline came first (``wait`` is
        then cancelled).

    Raises:
        Exception: Whatever ``wait()`` raised, as itself (never wrapped in an exception group).
    """
    finished = False
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def timer() -> None:
            await clock.sleep_until(deadline)
            group.cancel_scope.cancel()

        async def waiter() -> None:
            nonlocal finished, error
            try:
                await wait()
            except Exception as exc:  # re-raised below, outside the task group
                error = exc
            else:
                finished = True
            group.cancel_scope.cancel()

        group.start_soon(timer)
        group.start_soon(waiter)
    if error is not None:
        raise error
    return finished


async def run_until(
    clock: Clock, deadline: float, work: Callable[[], Awaitable[T]], *, what: str
) -> T:
    """Run ``work()`` but give up when the clock reaches ``deadline``.

    Raises:
        DeadlineExceededError: The deadline came first; ``work`` was cancelled.
    """
    outcome: list[T] = []

    async def capture() -> None:
        outcome.append(await work())

    if not await wait_until(clock, deadline, capture):
        raise DeadlineExceededError(f"the deadline passed while waiting for {what}")
    return outcome[0]
