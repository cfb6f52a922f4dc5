"""Retire marks and restore fences: per rollout, the highest attempt that is refused.

A **retire mark** rises through retire and only ``forget`` removes it. A **restore fence** rises
through a successful restore, on the checkpointed attempt N of every episode of its scope, so late
work of the crashed attempt is refused while N+1 runs. It goes when the rollout is forgotten, and
when a retire mark reaches it (the retire of N+1, say): the mark then refuses everything the fence
did. The two are counted apart (``retired_rollouts`` and ``restore_fences`` in status), so a
controller that forgets only what it retired sees no retire mark left (D223, D224).

Every data-plane request of a rollout whose attempt is at or below its mark or its fence is
refused with ``stale_attempt``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from protocols import EpisodeId, StaleAttemptError


class RetireMarks:
    """The retire marks and restore fences of one participant."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}
        self._fences: dict[str, int] = {}

    def raise_to(self, episodes: Iterable[EpisodeId]) -> None:
        """Raise each rollout's retire mark to at least the given attempt; never lowers one.

        A restore fence the mark now covers goes: the mark refuses all it refused.
        """
        for episode in episodes:
            rollout = episode.rollout_id
            mark = max(self._marks.get(rollout, -1), episode.attempt)
            self._marks[rollout] = mark
            if self._fences.get(rollout, mark + 1) <= mark:
                del self._fences[rollout]

    def fence(self, episodes: Iterable[EpisodeId]) -> None:
        """Raise each rollout's restore fence to at least the given attempt.

        Nothing is raised where a retire mark already refuses that attempt.
        """
        marks, fences = self._marks, self._fences  # a restore fences thousands at once
        for episode in episodes:
            rollout, attempt = episode.rollout_id, episode.attempt
            if attempt > fences.get(rollout, -1) and attempt > marks.get(rollout, -1):
                fences[rollout] = attempt

    def refused_through(self, rollout_id: str) -> int | None:
        """The highest refused attempt of ``rollout_id`` (mark or fence), or ``None``."""
        highest = max(self._marks.get(rollout_id, -1), self._fences.get(rollout_id, -1))
        return None if highest < 0 else highest

    def is_retired(self, episode: EpisodeId) -> bool:
        """Whether ``episode`` is at or below its rollout's mark or fence."""
        highest = self.refused_through(episode.rollout_id)
        return highest is not None and episode.attempt <= highest

    def check(self, episode: EpisodeId) -> None:
        """Refuse a retired or fenced attempt.

        Raises:
            StaleAttemptError: The attempt is at or below its rollout's mark or fence.
        """
        if not self.is_retired(episode):
            return
        rollout = episode.rollout_id
        if episode.attempt <= self._marks.get(rollout, -1):
            raise StaleAttemptError(
                f"{episode.capture_key} was retired (attempts up to {self._marks[rollout]} of "
                f"{rollout!r} are refused)"
            )
        raise StaleAttemptError(
            f"{episode.capture_key} was fenced by a restore (attempts up to "
            f"{self._fences[rollout]} of {rollout!r} are refused)"
        )

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Remove the marks and fences of these rollouts."""
        for rollout_id in rollout_ids:
            self._marks.pop(rollout_id, None)
            self._fences.pop(rollout_id, None)

    def snapshot(self) -> Mapping[str, int]:
        """Every refusal: rollout id → highest refused attempt (mark or fence)."""
        refused = dict(self._fences)
        for rollout, mark in self._marks.items():
            refused[rollout] = max(mark, refused.get(rollout, -1))
        return refused

    def retire_marks(self) -> Mapping[str, int]:
        """A copy of the retire marks alone: rollout id → highest retired attempt."""
        return dict(self._marks)

    def restore_fences(self) -> Mapping[str, int]:
        """A copy of the restore fences a retire mark does not cover."""
        return dict(self._fences)

    @property
    def retired_rollouts(self) -> int:
        """Rollouts with a retire mark (``retired_rollouts`` in status)."""
        return len(self._marks)

    @property
    def fenced_rollouts(self) -> int:
        """Rollouts with a restore fence no retire mark covers (``restore_fences`` in status)."""
        return len(self._fences)
