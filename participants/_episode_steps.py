"""Episode steps: where each environment episode is, and when it may be cut (control-plane §4.1).

An episode moves through steps separated by boundaries. Between a boundary and the next step it
is ``running``; inside a step it is in a ``wait_step`` (the checkpoint waits for the step) or a
``replay_step`` (the checkpoint does not wait: after a crash the step runs again from the boundary
before it); at a boundary while a checkpoint is open it is ``parked``. An episode blocks prepare
iff it is retired (until it has stopped), or it is not a restart and is ``running`` or in a
``wait_step``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ._participant import ChangeNotifier

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
    """

    key: str
    state: StepState = "running"
    boundary: dict[str, Any] | None = None
    retired: bool = False
    restart: bool = False
    finishing: bool = False
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

    def open(self) -> None:
        """The checkpoint ended: parked episodes continue."""
        self.accepting = True
        self._opened.set()
        self.changes.notify()

    async def wait_open(self) -> None:
        """Return once no checkpoint is open (the lease bounds how long one stays open)."""
        while not self.accepting:
            await self._opened.wait()

    # ------------------------------------------------------------------ lifecycle

    def begin(self, key: str, boundary: dict[str, Any] | None) -> TrackedEpisode:
        """Track a new episode, at ``boundary`` when it continues a restored one."""
        episode = TrackedEpisode(key=key, boundary=boundary)
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
                episode.state = "parked"
                self.changes.notify()
                await self._opened.wait()
        episode.state = "running"
        self.changes.notify()

    @asynccontextmanager
    async def step(self, episode: TrackedEpisode, mode: StepMode) -> AsyncIterator[None]:
        """Run one step of ``episode`` in ``mode``.

        A replay step that ends while a checkpoint is open stays counted at the boundary before it
        (not a blocker) until its next boundary parks it. If it fails while a checkpoint is open,
        the episode's boundary becomes ``None``: a checkpoint then exports it to start over from
        its input, and one failing episode cannot keep the checkpoint from being taken.
        """
        episode.state = "wait_step" if mode == "wait" else "replay_step"
        self.changes.notify()
        try:
            yield
        except Exception:
            if mode == "replay" and not self.accepting:
                episode.boundary = None
            else:
                episode.state = "running"
            self.changes.notify()
            raise
        if mode == "wait" or self.accepting:
            episode.state = "running"
        self.changes.notify()

    async def mark_restart(self, episode: TrackedEpisode) -> None:
        """Flag ``episode`` as a restart, once no checkpoint is open (the sets stay fixed in one)."""
        await self.wait_open()
        episode.restart = True
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

    async def stop(self, episode: TrackedEpisode) -> None:
        """Retire ``episode``: refuse it, cancel it unless it is finishing, wait until it stopped."""
        episode.retired = True
        self.changes.notify()
        if not episode.finishing:
            episode.scope.cancel()
        await episode.stopped.wait()
        self.end(episode)

    # ------------------------------------------------------------------ readiness

    def blockers(self) -> list[str]:
        """Capture keys of the episodes that block a safe cut."""
        return [key for key, episode in self.episodes.items() if episode.blocks]

    def restarts(self) -> list[str]:
        """Capture keys of the restart episodes that are not retired."""
        return [k for k, e in self.episodes.items() if e.restart and not e.retired]
