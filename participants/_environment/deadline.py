"""An episode's time budget, which stops counting while a checkpoint holds the episode (§2.5).

An environment may give every episode a budget of seconds. The budget counts while the episode
runs; it is suspended while the episode is parked for a checkpoint, or in a replay step while a
checkpoint is open (the episode then counts as parked at the boundary before that step), and it
resumes with the time that was left once the checkpoint ends. A checkpoint therefore never makes
an episode run out of time. :meth:`EpisodeDeadline.watch` cancels the episode's work when the
budget is used up while counting; time is read from an injected :class:`Clock`, so tests move it
by hand.
"""

from __future__ import annotations

import anyio

from .._runtime.clock import Clock, wait_until


class EpisodeDeadline:
    """The remaining budget of one episode.

    Args:
        clock: Where time is read and waited for.
        seconds: The whole budget; it starts counting at once.
    """

    def __init__(self, clock: Clock, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"an episode budget must be positive, not {seconds!r}")
        self.clock = clock
        self.seconds = seconds
        self.expired = False
        self._remaining = seconds
        self._counting_since: float | None = clock.time()
        self._changed = anyio.Event()

    @property
    def suspended(self) -> bool:
        """Whether the budget is stopped (a checkpoint holds the episode)."""
        return self._counting_since is None

    def remaining(self) -> float:
        """Seconds left now (never below zero)."""
        left = self._remaining
        if self._counting_since is not None:
            left -= self.clock.time() - self._counting_since
        return max(0.0, left)

    def suspend(self) -> None:
        """Stop counting, keeping what is left; a no-op when already suspended."""
        if self._counting_since is not None:
            self._remaining = self.remaining()
            self._counting_since = None
            self._wake()

    def resume(self) -> None:
        """Count again from what was left; a no-op when already counting."""
        if self._counting_since is None:
            self._counting_since = self.clock.time()
            self._wake()

    async def watch(self, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` once the budget runs out while counting; return after that.

        Runs until cancelled itself when the budget never runs out.
        """
        while True:
            changed = self._changed
            if self._counting_since is None:
                await changed.wait()
                continue
            due = self._counting_since + self._remaining
            if await wait_until(self.clock, due, changed.wait):
                continue  # suspended or resumed meanwhile: take the new due time
            if self._counting_since is not None and self.remaining() <= 0:
                self.expired = True
                scope.cancel()
                return

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
