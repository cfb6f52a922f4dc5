"""Retire and forget of the resources server's sessions, one retire request at a time (D389).

A retire refuses the sessions of the attempts its batch covers at once, waits for their seeds and
in-flight calls to end, then frees them; forget refuses while a retired session is not freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from protocols import EpisodeId, RetireIncompleteError, attempts_through

from .._runtime.participant import ChangeNotifier
from .models import ResourcesSession, unfreed_sessions


class SessionRetire:
    """The retire hooks of ``ResourcesParticipant``, over its sessions and seeds."""

    sessions: dict[str, ResourcesSession]
    seeds: Counter[EpisodeId]
    changes: ChangeNotifier

    async def _free(self, session: ResourcesSession) -> None:
        raise NotImplementedError

    async def retire(self, episode_id: EpisodeId) -> None:
        """``retire_many`` of the one attempt."""
        await self.retire_many([episode_id])

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Refuse the sessions of the attempts the batch covers, wait for them, free them; one
        pass over the sessions for the whole batch (D389)."""
        through = attempts_through(episode_ids)

        def covered(episode: EpisodeId) -> bool:
            return episode.attempt <= through.get(episode.rollout_id, -1)

        await self.changes.wait_for(lambda: not any(covered(e) for e in self.seeds))
        doomed = [s for s in self.sessions.values() if covered(s.episode_id)]
        for session in doomed:
            session.retired = True  # refused from here on, even if this retire is cut short
        self.changes.notify()
        await self.changes.wait_for(lambda: all(s.inflight == 0 for s in doomed))
        for session in doomed:
            await self._free(session)

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        """New marks change who is admitted: wake whoever watches for that."""
        self.changes.notify()

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        """Refuse to drop the marks while a retired session of these rollouts is not freed.

        Raises:
            RetireIncompleteError: Retire again first; nothing changed.
        """
        unfreed = unfreed_sessions(self.sessions.values(), rollout_ids)
        if unfreed:
            raise RetireIncompleteError(
                f"retired sessions are not freed yet: {unfreed[:10]}; retire again first"
            )
