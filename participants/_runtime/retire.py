"""Retire and forget for one control plane: free finished attempts, then forget their marks.

A retire raises the retire marks first (so late work of the named attempts is refused at once),
waits for a restore's install to finish, and then has the participant stop each attempt; forget
removes the marks of rollouts that are finished for good. Both are refused while a checkpoint is
open, and under a restore they run under its id and renew its lease.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from protocols import (
    ALLOWED_PHASES,
    CheckpointConflictError,
    EpisodeId,
    ForgetReply,
    ForgetRequest,
    InvalidPhaseError,
    Phase,
    PhaseEvent,
    RetireReply,
    RetireRequest,
)

from .clock import run_until

if TYPE_CHECKING:
    from .procedure import PlaneAccess
    from .restore import RestoreProcedure


def _to_stop(episodes: Sequence[EpisodeId]) -> str:
    """What a retire cut short by its deadline was waiting for, in a few words."""
    first = episodes[0].capture_key
    if len(episodes) == 1:
        return f"{first} to stop"
    return f"{len(episodes)} attempts ({first} first) to stop"


class RetireProcedure:
    """Retire and forget for one control plane.

    Args:
        plane: The control plane these procedures belong to.
        restores: The plane's restore procedure, whose install a retire waits for.
    """

    def __init__(self, plane: PlaneAccess, restores: RestoreProcedure) -> None:
        self._plane = plane
        self._restores = restores

    def _admit(self, checkpoint_id: str, event: PhaseEvent) -> None:
        plane = self._plane
        # Outside an open checkpoint the id is only a label, so no stale-id check applies.
        if plane.phase not in ALLOWED_PHASES[event]:
            raise InvalidPhaseError(
                f"{event.value} is refused while checkpoint {plane.checkpoint_id!r} is open "
                f"(phase {plane.phase.value}); resume first"
            )
        if plane.phase is Phase.RESTORED and checkpoint_id != plane.checkpoint_id:
            raise CheckpointConflictError(
                f"restore {plane.checkpoint_id!r} is active; retire under its id or resume first"
            )

    async def retire(self, request: RetireRequest) -> RetireReply:
        """Refuse, stop, then free the named attempts and every earlier one."""
        plane = self._plane
        request = plane.bounded(request)
        deadline = request.deadline_ts
        async with plane.lock:
            await plane.expire_lease_if_due()
            self._admit(request.checkpoint_id, PhaseEvent.RETIRE)
            if plane.phase is Phase.RESTORED:
                plane.renew_lease(deadline)
            plane.marks.raise_to(request.episode_ids)
            await run_until(
                plane.clock,
                deadline,
                lambda: plane.participant.mark_retired(request.episode_ids),
                what="retire marks to propagate",
            )
        await self._restores.wait_for_install(deadline)
        # The whole batch in one call, so a participant pays its I/O once per request (D389).
        episodes = request.episode_ids
        await run_until(
            plane.clock,
            deadline,
            functools.partial(plane.participant.retire_many, episodes),
            what=_to_stop(episodes),
        )
        plane.participant.changes.notify()
        return RetireReply(retired=[episode.capture_key for episode in request.episode_ids])

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        """Remove the retire marks of rollouts that are finished for good."""
        plane = self._plane
        request = plane.bounded(request)
        rollout_ids = sorted(set(request.rollout_ids))
        async with plane.lock:
            await plane.expire_lease_if_due()
            self._admit(request.checkpoint_id, PhaseEvent.FORGET)
            if plane.phase is Phase.RESTORED:
                plane.renew_lease(request.deadline_ts)
            await run_until(
                plane.clock,
                request.deadline_ts,
                lambda: plane.participant.forget(rollout_ids),
                what="the participant to accept forget",
            )
            plane.marks.forget(rollout_ids)
        return ForgetReply(forgotten=rollout_ids)
