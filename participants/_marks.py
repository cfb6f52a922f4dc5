"""Retire marks: per rollout, the highest attempt that is refused.

A mark only rises (through retire, or through a restore fencing the checkpointed attempt) and
only ``forget`` removes it. Every data-plane request of a rollout whose attempt is at or below
its mark is refused with ``stale_attempt``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from protocols import EpisodeId, StaleAttemptError


class RetireMarks:
    """The retire marks of one participant."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def raise_to(self, episodes: Iterable[EpisodeId]) -> None:
        """Raise each rollout's mark to at least the given attempt; never lowers one."""
        for episode in episodes:
            current = self._marks.get(episode.rollout_id, -1)
            if episode.attempt > current:
                self._marks[episode.rollout_id] = episode.attempt

    def is_retired(self, episode: EpisodeId) -> bool:
        """Whether ``episode`` is at or below its rollout's mark."""
        mark = self._marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def check(self, episode: EpisodeId) -> None:
        """Refuse a retired or fenced attempt.

        Raises:
            StaleAttemptError: The attempt is at or below its rollout's mark.
        """
        if self.is_retired(episode):
            raise StaleAttemptError(
                f"{episode.capture_key} was retired or fenced (attempts up to "
                f"{self._marks[episode.rollout_id]} of {episode.rollout_id!r} are refused)"
            )

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Remove the marks of these rollouts."""
        for rollout_id in rollout_ids:
            self._marks.pop(rollout_id, None)

    def snapshot(self) -> Mapping[str, int]:
        """A copy of every mark: rollout id → highest refused attempt."""
        return dict(self._marks)

    def __len__(self) -> int:
        return len(self._marks)
