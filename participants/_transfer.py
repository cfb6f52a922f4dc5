"""Commit and restore: the two control operations that move records to and from disk.

Both start work that may outlive the call (export, write, post-write cleanup, install). A retry
of the same call waits for the same work instead of starting it again; the write itself is never
cancelled, only stopped before publication by ``resume``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from protocols import (
    CheckpointConflictError,
    CheckpointError,
    CommitReply,
    CommitRequest,
    DeadlineExceededError,
    EpisodeId,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    Phase,
    PhaseEvent,
    RestartInScopeError,
    RestoreReply,
    RestoreRequest,
    StaleCheckpointError,
    sorted_capture_keys,
)

from ._checkpoint_root import participant_path
from ._clock import wait_until
from ._collector import collector_paused
from ._jobs import Job
from ._participant import Participant, Record
from ._restore_batch import RestoreScope
from ._storage import ParticipantCheckpoint, RecordsWriter, read_participant_checkpoint

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._runtime import ControlPlane


def record_episode(record: Any, index: int) -> EpisodeId:
    """The attempt a record belongs to.

    Raises:
        InvalidCheckpointStateError: The record has no valid ``episode_id``.
    """
    try:
        return EpisodeId.model_validate(record["episode_id"])
    except (KeyError, TypeError, ValidationError) as exc:
        raise InvalidCheckpointStateError(
            f"record {index} has no valid episode_id: {exc}"
        ) from None


def _in_scope(scope: RestoreScope, record: dict[str, Any]) -> bool:
    try:
        return scope.in_scope(record["episode_id"])
    except (KeyError, TypeError, ValidationError):
        return True  # kept, so that validation refuses the whole restore


def _restored_keys(records: Sequence[Record], scope: RestoreScope) -> list[str]:
    """The sorted capture keys of the next attempts the records install."""
    keys = []
    for index, record in enumerate(records):
        try:
            episode = scope.episode(record["episode_id"])
        except (KeyError, TypeError, ValidationError):
            episode = record_episode(record, index)  # raises with the record's index
        keys.append(scope.next_attempt(episode).capture_key)
    return sorted(keys)


def _read_paused(directory: Path, **options: Any) -> ParticipantCheckpoint:
    # The parsed records all stay alive until the install: no garbage to collect (D266).
    with collector_paused():
        return read_participant_checkpoint(directory, **options)


async def _install_paused(
    participant: Participant, records: list[Record], scope: RestoreScope
) -> None:
    # Installing builds state that lives on; the collector would traverse it again and again.
    with collector_paused():
        await participant.install(records, scope)


@dataclass(eq=False)
class _Commit:
    checkpoint_id: str
    args: tuple[str, tuple[str, ...] | None]
    directory: Path  # this participant's own directory inside the checkpoint
    scope: list[EpisodeId] | None
    export_job: Job[list[Record]] | None = None
    writer: RecordsWriter | None = None
    write_job: Job[dict[str, Any]] | None = None
    cleanup_job: Job[None] | None = None
    park_job: Job[None] | None = None
    exported_keys: set[str] = field(default_factory=set)  # of the records, validated by _export


class CommitProcedure:
    """Commit for one control plane: re-check, export once, write, clean up, reply.

    Args:
        plane: The control plane this procedure belongs to.
        on_write_step: Test hook passed to every ``RecordsWriter``.
    """

    def __init__(self, plane: ControlPlane, *, on_write_step: Callable[[str], None] | None) -> None:
        self._plane = plane
        self._on_write_step = on_write_step
        self._current: _Commit | None = None
        self._cleanup: Job[None] | None = None

    async def run(self, request: CommitRequest) -> CommitReply:
        """Run (or rejoin) the commit of ``request.checkpoint_id``."""
        plane = self._plane
        request = plane.bounded(request)
        directory, own = participant_path(plane, request.checkpoint_dir)
        scope = request.episode_ids
        scope_keys = None if scope is None else tuple(sorted_capture_keys(scope))
        args = (str(directory), scope_keys)
        deadline = request.deadline_ts
        async with plane.lock:
            await plane.expire_lease_if_due()
            stored = plane.admit(request.checkpoint_id, PhaseEvent.COMMIT, args)
            plane.renew_lease(deadline)
            if isinstance(stored, CommitReply):
                return stored
            commit = self._current
            if commit is not None and commit.checkpoint_id == request.checkpoint_id:
                if commit.args != args:
                    raise CheckpointConflictError(
                        f"a commit of {request.checkpoint_id!r} into another directory or "
                        "scope is under way"
                    )
            else:
                report = plane.report()
                if not report.ready:
                    raise InvalidPhaseError(
                        f"no longer ready to commit: blockers={report.blockers[:10]} "
                        f"({report.blocker_count} in all); nothing was written"
                    )
                clash = set(scope_keys or ()) & set(report.restarts)
                if clash:
                    raise RestartInScopeError(
                        f"the scope names episodes reported as restarts: {sorted(clash)[:10]}"
                    )
                commit = _Commit(request.checkpoint_id, args, own, scope)
                self._current = commit
            if commit.export_job is None or commit.export_job.failed:
                commit.export_job = Job.start(
                    plane.task_group,
                    f"export of checkpoint {commit.checkpoint_id!r}",
                    functools.partial(self._export, commit),
                )
        records = await commit.export_job.result(plane.clock, deadline)
        async with plane.lock:
            self._ensure_current(commit)
            if commit.write_job is None or commit.write_job.failed:
                commit.write_job = self._start_write(commit, records)
        manifest = await commit.write_job.result(plane.clock, deadline)
        async with plane.lock:
            self._ensure_current(commit)
            if commit.cleanup_job is None:
                commit.cleanup_job = Job.start(
                    plane.task_group,
                    f"deletion of restored state outside checkpoint {commit.checkpoint_id!r}",
                    functools.partial(self._delete_restored_outside, commit),
                )
                self._cleanup = commit.cleanup_job
        await commit.cleanup_job.result(plane.clock, deadline)
        async with plane.lock:
            self._ensure_current(commit)
            stored = plane.admit(request.checkpoint_id, PhaseEvent.COMMIT, args)
            if isinstance(stored, CommitReply):
                return stored  # a concurrent retry finished first
            if request.stop and commit.park_job is None:
                commit.park_job = Job.start(
                    plane.task_group, "park_exported", functools.partial(self._park, records)
                )
            plane.transition(PhaseEvent.COMMIT)
            reply = CommitReply.model_validate(
                {
                    **plane.participant.commit_reply(records),
                    "phase": Phase.COMMITTED,
                    "manifest": manifest,
                    "episode_ids": sorted(commit.exported_keys),
                }
            )
            return plane.store_result(commit.checkpoint_id, PhaseEvent.COMMIT, args, reply)

    def _start_write(self, commit: _Commit, records: list[Record]) -> Job[dict[str, Any]]:
        plane = self._plane
        participant = plane.participant
        writer = RecordsWriter(
            commit.directory,
            kind=participant.kind,
            instance=participant.instance,
            checkpoint_id=commit.checkpoint_id,
            on_step=self._on_write_step,
        )
        commit.writer = writer
        extra = participant.manifest_extra()

        async def write() -> dict[str, Any]:
            # A thread is never interrupted, so the write cannot be cancelled half-way.
            return await anyio.to_thread.run_sync(
                functools.partial(writer.write, records, extra=extra)
            )

        return Job.start(plane.task_group, f"write of checkpoint {commit.checkpoint_id!r}", write)

    async def _export(self, commit: _Commit) -> list[Record]:
        plane = self._plane
        records = list(await plane.participant.export(commit.scope))
        wanted = None if commit.scope is None else {e.capture_key for e in commit.scope}
        keys = set()
        for index, record in enumerate(records):
            episode = record_episode(record, index)
            keys.add(episode.capture_key)
            if wanted is not None and episode.capture_key not in wanted:
                raise InvalidCheckpointStateError(
                    f"the participant exported {episode.capture_key}, which is outside the scope"
                )
            if plane.marks.is_retired(episode):
                raise InvalidCheckpointStateError(
                    f"the participant exported {episode.capture_key}, a retired attempt"
                )
        commit.exported_keys = keys
        return records

    async def _delete_restored_outside(self, commit: _Commit) -> None:
        if commit.scope is None:
            return  # a null scope exports everything and deletes nothing
        wanted = {episode.capture_key for episode in commit.scope}
        for episode in self._plane.participant.restored_pending():
            if episode.capture_key not in wanted:
                await self._plane.participant.delete_restored(episode)

    async def _park(self, records: Sequence[Record]) -> None:
        try:
            await self._plane.participant.park_exported(records)
        except Exception as exc:  # freeing outside compute is best effort: log, never fail
            self._plane.telemetry.event("park_exported_failed", error=repr(exc))

    def _ensure_current(self, commit: _Commit) -> None:
        if self._current is not commit or self._plane.checkpoint_id != commit.checkpoint_id:
            raise StaleCheckpointError(f"checkpoint {commit.checkpoint_id!r} was resumed")

    async def abort(self, deadline: float) -> None:
        """Stop the active commit's writer and export; wait (until ``deadline``) for cleanup.

        Raises:
            DeadlineExceededError: Restored state is still being deleted.
        """
        commit = self._current
        if commit is not None:
            if commit.writer is not None:
                # stop() waits only for a publication already under way, then forbids any.
                await anyio.to_thread.run_sync(commit.writer.stop)
            if commit.export_job is not None:
                commit.export_job.cancel()
        cleanup = self._cleanup
        if (
            cleanup is not None
            and not cleanup.done
            and not await wait_until(self._plane.clock, deadline, cleanup.wait_done)
        ):
            raise DeadlineExceededError("restored state is still being deleted; resume again")
        self._current = None
        self._cleanup = None


class RestoreProcedure:
    """Restore for one control plane: read and verify, then install everything or nothing."""

    def __init__(self, plane: ControlPlane) -> None:
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
        directory, own = participant_path(plane, request.checkpoint_dir)
        scope = RestoreScope(request.episode_ids)  # one index, shared by every step below
        scope_keys = sorted_capture_keys(scope)
        args = (str(directory), tuple(scope_keys))
        deadline = request.deadline_ts
        async with plane.lock:
            await plane.expire_lease_if_due()
            stored = plane.admit(request.checkpoint_id, PhaseEvent.RESTORE, args)
            if isinstance(stored, RestoreReply):
                plane.renew_lease(deadline)
                return stored
            self._refuse_live_process()
        share = await anyio.to_thread.run_sync(
            functools.partial(
                _read_paused,
                own,
                kind=participant.kind,
                instance=participant.instance,
                select=functools.partial(_in_scope, scope),
            )
        )
        records = share.records
        restored = _restored_keys(records, scope)
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
                functools.partial(_install_paused, participant, records, scope),
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
