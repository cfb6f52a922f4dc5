"""Episode steps: where each environment episode is, and when it may be cut (control-plane §4.1).

An episode moves through steps separated by boundaries. Between a boundary and the next step it
is ``running``; inside a step it is in a ``wait_step`` (the checkpoint waits for the step) or a
``replay_step`` (the checkpoint does not wait: after a crash the step runs again from the boundary
before it); at a boundary while a checkpoint is open it is ``parked``. An episode blocks prepare
iff it is retired (until it has stopped), or it is not a restart and is ``running`` or in a
``wait_step``. An episode's deadline, when it has one, is suspended while a checkpoint holds it:
parked, or in a replay step while a checkpoint is open (never for a restart, which is not held).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from .._runtime.participant import ChangeNotifier
from .deadline import EpisodeDeadline

StepState = Literal["running", "wait_step", "replay_step", "parked"]
StepMode = Literal["wait", "replay"]


@dataclass(eq=False)
class TrackedEpisode:
    """One live episode and the flags the tracker keeps for it.

    Attributes:
        key: The capture key of the attempt.
        state: Where the episode is (see the module docstring).
        boundary: The latest boundary recorded, ``None`` before the first one.
        retired: A retire is stopping it; it blocks prepare until it has stopped.
        restart: It uses a server that cannot capture its part: it never blocks or parks.
        finishing: Final clean-up has begun; a retire waits for it instead of cancelling.
        deadline: Its time budget, if the environment gives one.
    """

    key: str
    state: StepState = "running"
    boundary: dict[str, Any] | None = None
    retired: bool = False
    restart: bool = False
    finishing: bool = False
    deadline: EpisodeDeadline | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    stopped: anyio.Event = field(default_factory=anyio.Event)

    @property
    def blocks(self) -> bool:
        """Whether this episode prevents a safe cut now."""
        if self.retired:
            return True
        return not self.restart and self.state in ("running", "wait_step")

    @property
    def exportable(self) -> bool:
        """Whether a commit exports it: parked or in a replay step, not retired, not a restart."""
        return not self.retired and not self.restart and self.state in ("parked", "replay_step")


class EpisodeSteps:
    """The step tracker of one environment server.

    Args:
        changes: Notified whenever readiness may have changed.
    """

    def __init__(self, changes: ChangeNotifier) -> None:
        self.changes = changes
        self.episodes: dict[str, TrackedEpisode] = {}
        self.accepting = True
        self._opened = anyio.Event()
        self._opened.set()

    # ------------------------------------------------------------------ admission

    def close(self) -> None:
        """A checkpoint opened: episodes park at their next boundary."""
        if self.accepting:
            self.accepting = False
            self._opened = anyio.Event()
            for episode in self.episodes.values():
                self._pace(episode)

    def open(self) -> None:
        """The checkpoint ended: parked episodes continue."""
        self.accepting = True
        self._opened.set()
        for episode in self.episodes.values():
            self._pace(episode)
        self.changes.notify()

    async def wait_open(self) -> None:
        """Return once no checkpoint is open (the lease bounds how long one stays open)."""
        while not self.accepting:
            await self._opened.wait()

    # ------------------------------------------------------------------ lifecycle

    def begin(
        self,
        key: str,
        boundary: dict[str, Any] | None,
        deadline: EpisodeDeadline | None = None,
    ) -> TrackedEpisode:
        """Track a new episode, at ``boundary`` when it continues a restored one.

        A restored episode admitted while a checkpoint is open stands at its boundary: it starts
        parked, so it never blocks the prepare it arrived in (D218).
        """
        episode = TrackedEpisode(key=key, boundary=boundary, deadline=deadline)
        if boundary is not None and not self.accepting:
            episode.state = "parked"
            self._pace(episode)
        self.episodes[key] = episode
        self.changes.notify()
        return episode

    async def boundary(self, episode: TrackedEpisode, boundary: dict[str, Any] | None) -> None:
        """Record ``boundary``; while a checkpoint is open, park there until it ends.

        A checkpoint that closes admission again before the episode wakes keeps it parked.
        """
        episode.boundary = boundary
        if not episode.restart:
            while not self.accepting:
                self._enter(episode, "parked")
                await self._opened.wait()
        self._enter(episode, "running")

    @asynccontextmanager
    async def step(self, episode: TrackedEpisode, mode: StepMode) -> AsyncIterator[None]:
        """Run one step of ``episode`` in ``mode``.

        A replay step that ends while a checkpoint is open stays counted at the boundary before it
        (not a blocker) until its next boundary parks it. If it fails while a checkpoint is open,
        the episode's boundary becomes ``None``: a checkpoint then exports it to start over from
        its input, and one failing episode cannot keep the checkpoint from being taken.
        """
        self._enter(episode, "wait_step" if mode == "wait" else "replay_step")
        try:
            yield
        except Exception:
            if mode == "replay" and not self.accepting:
                episode.boundary = None
                self.changes.notify()
            else:
                self._enter(episode, "running")
            raise
        if mode == "wait" or self.accepting:
            self._enter(episode, "running")
        else:
            self.changes.notify()

    async def mark_restart(self, episode: TrackedEpisode) -> None:
        """Flag ``episode`` as a restart, once no checkpoint is open (the sets stay fixed in one)."""
        await self.wait_open()
        episode.restart = True
        self._pace(episode)
        self.changes.notify()

    def finishing(self, episode: TrackedEpisode) -> None:
        """Final clean-up begins: a retire now waits for the episode instead of cancelling it."""
        episode.finishing = True

    def end(self, episode: TrackedEpisode) -> None:
        """Stop tracking ``episode``."""
        if self.episodes.get(episode.key) is episode:
            del self.episodes[episode.key]
        episode.stopped.set()
        self.changes.notify()

    def halt(self, episode: TrackedEpisode) -> None:
        """Refuse ``episode`` and cancel it unless it is finishing; waits for nothing."""
        episode.retired = True
        self.changes.notify()
        if not episode.finishing:
            episode.scope.cancel()

    async def stop(self, episode: TrackedEpisode) -> None:
        """Retire ``episode``: ``halt`` it, then wait until it stopped."""
        self.halt(episode)
        await episode.stopped.wait()
        self.end(episode)

    def _enter(self, episode: TrackedEpisode, state: StepState) -> None:
        episode.state = state
        self._pace(episode)
        self.changes.notify()

    def _pace(self, episode: TrackedEpisode) -> None:
        # The deadline stops while a checkpoint holds the episode, so a checkpoint never makes it
        # run out of time; a restart is never held, so its deadline always counts.
        if episode.deadline is None:
            return
        held = not self.accepting and not episode.restart
        if held and episode.state in ("parked", "replay_step"):
            episode.deadline.suspend()
        else:
            episode.deadline.resume()

    # ------------------------------------------------------------------ readiness

    def blockers(self) -> list[str]:
        """Capture keys of the episodes that block a safe cut."""
        return [key for key, episode in self.episodes.items() if episode.blocks]

    def restarts(self) -> list[str]:
        """Capture keys of the restart episodes that are not retired."""
        return [k for k, e in self.episodes.items() if e.restart and not e.retired]
