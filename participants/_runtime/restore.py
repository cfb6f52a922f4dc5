"""Restore: read and verify one participant's share of a checkpoint, then install it whole.

The records are read and installed with the cyclic collector paused (D266), against one scope
index (D264); a retry of the same restore waits for the same install instead of starting another.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry import trace
from pydantic import ValidationError

from protocols import (
    INSTALL_SPAN,
    READ_SPAN,
    CheckpointConflictError,
    CheckpointError,
    DeadlineExceededError,
    EpisodeId,
    Phase,
    PhaseEvent,
    RestoreReply,
    RestoreRequest,
)

from .._storage.checkpoint_root import participant_path
from .._storage.checkpoint_store import (
    ParticipantCheckpoint,
    ShareLocation,
    read_participant_checkpoint,
)
from .._tracing import checkpoint_span, set_checkpoint_attributes
from .clock import wait_until
from .collector import collector_paused
from .commit import record_episode
from .jobs import Job
from .participant import Participant, Record
from .restore_batch import RestoreScope

if TYPE_CHECKING:
    from .procedure import PlaneAccess


class _ScopeSelection:
    """The read's filter: keeps the records of the scope, and remembers whom each one names.

    The read calls it once per record, in order, and keeps the records it answers ``True`` for;
    ``named`` then holds, for each kept record, the scoped attempt it names, or ``None`` where it
    had to be validated in full (``_restored_keys`` looks that one up again). Remembering spares
    a second lookup per record on the event loop (D432).
    """

    def __init__(self, scope: RestoreScope) -> None:
        self._scope = scope
        self.named: list[EpisodeId | None] = []

    def __call__(self, record: dict[str, Any]) -> bool:
        found = self._scope.lookup(record.get("episode_id"))
        if found is not None:
            self.named.append(found)
            return True
        try:
            kept = self._scope.in_scope(record["episode_id"])
        except (KeyError, TypeError, ValidationError):
            kept = True  # kept, so that validation refuses the whole restore
        if kept:
            self.named.append(None)
        return kept


def _restored_keys(
    records: Sequence[Record], scope: RestoreScope, named: Sequence[EpisodeId | None]
) -> list[str]:
    """The sorted capture keys of the next attempts the records install.

    ``named`` is the read's selection: the scoped attempt of each record, where it was found.
    """
    if len(named) != len(records):
        named = [None] * len(records)
    found = [episode for episode in named if episode is not None]
    if len(found) == len(records):
        return sorted(scope.next_keys(found))  # every record named a scoped attempt (D439)
    keys = []
    for index, (record, episode) in enumerate(zip(records, named, strict=True)):
        if episode is None:
            try:
                episode = scope.episode(record["episode_id"])
            except (KeyError, TypeError, ValidationError):
                episode = record_episode(record, index)  # raises with the record's index
        keys.append(scope.next_key(episode))
    return sorted(keys)


def _read_paused(
    location: ShareLocation, checkpoint_id: str, **options: Any
) -> ParticipantCheckpoint:
    # The parsed records all stay alive until the install: no garbage to collect (D266).
    with collector_paused(), checkpoint_span(READ_SPAN, id=checkpoint_id) as span:
        share = read_participant_checkpoint(location, **options)
        set_checkpoint_attributes(span, records=len(share.records), bytes=share.bytes_read)
        return share


async def _install_paused(
    participant: Participant, records: list[Record], scope: RestoreScope, checkpoint_id: str
) -> None:
    # Installing builds state that lives on; the collector would traverse it again and again.
    with collector_paused(), checkpoint_span(INSTALL_SPAN, id=checkpoint_id, records=len(records)):
        await participant.install(records, scope)


class RestoreProcedure:
    """Restore for one control plane: read and verify, then install everything or nothing."""

    def __init__(self, plane: PlaneAccess) -> None:
        self._plane = plane
        self._install: Job[None] | None = None
        self._install_owner: str | None = None

    async def wait_for_install(self, deadline: float) -> None:
        """Wait for an install that outlived its restore call.

        Raises:
            DeadlineExceededError: It is still running at ``deadline``.
        """
        job = self._install
        if (
            job is not None
            and not job.done
            and not await wait_until(self._plane.clock, deadline, job.wait_done)
        ):
            raise DeadlineExceededError("a restore's install is still running; retry")

    async def run(self, request: RestoreRequest) -> RestoreReply:
        """Run the restore of ``request.checkpoint_id``."""
        plane = self._plane
        participant = plane.participant
        request = plane.bounded(request)
        directory, own = participant_path(
            request.checkpoint_dir,
            root=plane.settings.checkpoint_root,
            kind=plane.participant.kind,
            instance=plane.participant.instance,
        )
        scope = RestoreScope(request.episode_ids)  # one index, shared by every step below
        # The canonical location (resolved, or the URL) and the attempts in scope (D449).
        args = (str(directory), scope.identity())
        deadline = request.deadline_ts
        async with plane.lock:
            await plane.expire_lease_if_due()
            stored = plane.admit(request.checkpoint_id, PhaseEvent.RESTORE, args)
            if isinstance(stored, RestoreReply):
                plane.renew_lease(deadline)
                return stored
            self._refuse_live_process()
        selection = _ScopeSelection(scope)
        share = await anyio.to_thread.run_sync(
            functools.partial(
                _read_paused,
                own,
                request.checkpoint_id,
                kind=participant.kind,
                instance=participant.instance,
                select=selection,
            )
        )
        records = share.records
        plane.telemetry.moved("restore", records=len(records), size=share.bytes_read)
        # The restore's own id names the restore; the span also names the checkpoint it reads.
        set_checkpoint_attributes(
            trace.get_current_span(), source=share.manifest.get("checkpoint_id")
        )
        restored = _restored_keys(records, scope, selection.named)
        if plane.clock.time() >= deadline:
            raise DeadlineExceededError("the deadline passed while reading the checkpoint")
        await self.wait_for_install(deadline)
        async with plane.lock:
            plane.admit(request.checkpoint_id, PhaseEvent.RESTORE, args)
            if plane.checkpoint_id is not None:
                raise CheckpointConflictError(f"checkpoint {plane.checkpoint_id!r} became active")
            self._refuse_live_process()
            await participant.close_admission(request)
            try:
                participant.restore_manifest(share.manifest)
            except BaseException:
                await participant.open_admission()
                raise
            job = Job.start(
                plane.task_group,
                f"install of restore {request.checkpoint_id!r}",
                functools.partial(
                    _install_paused, participant, records, scope, request.checkpoint_id
                ),
            )
            self._install = job
            self._install_owner = request.checkpoint_id
        try:
            await job.result(plane.clock, deadline)
        except BaseException:
            with anyio.CancelScope(shield=True):
                async with plane.lock:
                    if job.done:
                        await self._reopen_if_owner(request.checkpoint_id)
                    else:
                        plane.task_group.start_soon(
                            self._reopen_after_install, job, request.checkpoint_id
                        )
            raise
        async with plane.lock:
            plane.checkpoint_id = request.checkpoint_id
            plane.transition(PhaseEvent.RESTORE)
            plane.renew_lease(deadline)
            # Restore fences attempt N: late work of the crashed attempt gets stale_attempt. A
            # fence is not a retire mark: forget, or a retire that reaches it, ends it (D224).
            if plane.settings.fence_on_restore:
                plane.marks.fence(scope)
                await participant.mark_retired(scope)
            participant.changes.notify()
            reply = RestoreReply(
                phase=Phase.RESTORED,
                source_checkpoint_id=str(share.manifest["checkpoint_id"]),
                restored=restored,
            )
            return plane.store_result(request.checkpoint_id, PhaseEvent.RESTORE, args, reply)

    def _refuse_live_process(self) -> None:
        if self._plane.participant.served_live_work():
            raise CheckpointError(
                "restore needs a fresh process: this one has already served live work"
            )

    async def _reopen_if_owner(self, checkpoint_id: str) -> None:
        plane = self._plane
        if self._install_owner == checkpoint_id and plane.checkpoint_id is None:
            await plane.participant.open_admission()

    async def _reopen_after_install(self, job: Job[None], checkpoint_id: str) -> None:
        await job.wait_done()
        async with self._plane.lock:
            await self._reopen_if_owner(checkpoint_id)
            self._plane.telemetry.event("reopen_after_install", checkpoint_id=checkpoint_id)
