"""Prepare for one control plane: close admission, then wait until every episode is parked.

A prepare is replayable under its id: a repeat while it waits joins the same wait, and a repeat
after it finished gets the stored reply. It ends ready (``PREPARED``), or at its deadline with the
readiness report of what still blocks it; a failure while closing or waiting reopens admission.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import anyio

from protocols import WAIT_READY_SPAN, CheckpointRequest, Phase, PhaseEvent, PrepareReply

from .._tracing import checkpoint_span, set_checkpoint_attributes
from .clock import wait_until

if TYPE_CHECKING:
    from .procedure import PlaneAccess


class PrepareProcedure:
    """Prepare for one control plane.

    Args:
        plane: The control plane this procedure belongs to.
    """

    def __init__(self, plane: PlaneAccess) -> None:
        self._plane = plane

    async def run(self, request: CheckpointRequest) -> PrepareReply:
        """Close admission and wait, until the deadline, for every episode to park."""
        plane = self._plane
        request = plane.bounded(request)
        checkpoint_id = request.checkpoint_id
        async with plane.lock:
            await plane.expire_lease_if_due()
            stored = plane.admit(checkpoint_id, PhaseEvent.PREPARE)
            if plane.phase is not Phase.IDLE:
                plane.renew_lease(request.deadline_ts)
            if isinstance(stored, PrepareReply):
                return stored
            if plane.phase is Phase.IDLE:
                plane.checkpoint_id = checkpoint_id
                plane.transition(PhaseEvent.PREPARE)
                plane.renew_lease(request.deadline_ts)
                try:
                    await plane.participant.close_admission(request)
                except BaseException:
                    await plane.abandon_prepare()
                    raise
        regressed: int | None = None
        while True:
            try:
                if regressed is not None:  # wait for the change that may make it ready again
                    wake_at = min(
                        request.deadline_ts,
                        plane.clock.time() + plane.settings.readiness_poll_seconds,
                    )
                    changes = plane.participant.changes
                    await wait_until(
                        plane.clock, wake_at, functools.partial(changes.wait_past, regressed)
                    )
                with checkpoint_span(WAIT_READY_SPAN, id=checkpoint_id) as span:
                    await self._wait_ready(checkpoint_id, request.deadline_ts)
                    if span.is_recording():  # a report is work: only for a recorded span
                        report = plane.report()
                        set_checkpoint_attributes(
                            span, ready=report.ready, blockers=report.blocker_count
                        )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    async with plane.lock:
                        if plane.checkpoint_id == checkpoint_id and plane.phase is Phase.PREPARING:
                            await plane.abandon_prepare()
                raise
            async with plane.lock:
                if plane.checkpoint_id != checkpoint_id:
                    return PrepareReply(phase=plane.phase, report=plane.report())
                replay = plane.stored_result(checkpoint_id, PhaseEvent.PREPARE)
                if isinstance(replay, PrepareReply):
                    return replay
                if plane.phase is not Phase.PREPARING:
                    return PrepareReply(phase=plane.phase, report=plane.report())
                report = plane.report()
                if report.ready:
                    plane.transition(PhaseEvent.READY)
                    reply = PrepareReply(phase=plane.phase, report=report)
                    return plane.store_result(checkpoint_id, PhaseEvent.PREPARE, None, reply)
                if plane.clock.time() < request.deadline_ts:
                    # Readiness regressed between the wait and the lock (a restored episode
                    # admitted meanwhile, say): only the deadline ends a prepare not ready (D218).
                    regressed = plane.participant.changes.version
                    continue
                plane.telemetry.event(
                    "prepare_not_ready",
                    checkpoint_id=checkpoint_id,
                    blocker_count=report.blocker_count,
                    blockers=report.blockers[:10],
                )
                return PrepareReply(phase=plane.phase, report=report)

    async def _wait_ready(self, checkpoint_id: str, deadline: float) -> None:
        plane = self._plane
        changes = plane.participant.changes
        while plane.checkpoint_id == checkpoint_id and plane.phase is Phase.PREPARING:
            seen = changes.version
            if plane.participant.ready():
                return
            now = plane.clock.time()
            if now >= deadline:
                return
            wake_at = min(deadline, now + plane.settings.readiness_poll_seconds)
            await wait_until(plane.clock, wake_at, functools.partial(changes.wait_past, seen))
