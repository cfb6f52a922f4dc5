"""Commit: the control operation that moves a participant's parked work to disk.

It starts work that may outlive the call (export, write, post-write cleanup). A retry of the same
call waits for the same work instead of starting it again; the write itself is never cancelled,
only stopped before publication by ``resume``. Restore, the way back, is in ``_restore_procedure``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from protocols import (
    EXPORT_SPAN,
    CheckpointConflictError,
    CommitReply,
    CommitRequest,
    DeadlineExceededError,
    EpisodeId,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    Phase,
    PhaseEvent,
    RestartInScopeError,
    StaleCheckpointError,
)

from .._storage.checkpoint_root import participant_path
from .._storage.checkpoint_store import RecordsWriter, ShareLocation
from .._tracing import checkpoint_span, set_checkpoint_attributes
from .clock import wait_until
from .jobs import Job
from .participant import Record
from .restore_batch import RestoreScope, scope_identity

if TYPE_CHECKING:
    from collections.abc import Callable

    from .procedure import PlaneAccess


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


@dataclass(eq=False)
class _Commit:
    checkpoint_id: str
    args: tuple[str, frozenset[tuple[str, int]] | None]
    share: ShareLocation  # this participant's own directory (or s3:// URL) in the checkpoint
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

    def __init__(self, plane: PlaneAccess, *, on_write_step: Callable[[str], None] | None) -> None:
        self._plane = plane
        self._on_write_step = on_write_step
        self._current: _Commit | None = None
        self._cleanup: Job[None] | None = None

    async def run(self, request: CommitRequest) -> CommitReply:
        """Run (or rejoin) the commit of ``request.checkpoint_id``."""
        plane = self._plane
        request = plane.bounded(request)
        directory, own = participant_path(
            request.checkpoint_dir,
            root=plane.settings.checkpoint_root,
            kind=plane.participant.kind,
            instance=plane.participant.instance,
        )
        scope = request.episode_ids
        # The canonical location (resolved, or the URL) and the attempts in scope (D449).
        args = (str(directory), None if scope is None else scope_identity(scope))
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
                clash = (
                    {e.capture_key for e in scope} & set(report.restarts)
                    if scope is not None and report.restarts
                    else set()
                )
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
            commit.share,
            kind=participant.kind,
            instance=participant.instance,
            checkpoint_id=commit.checkpoint_id,
            on_step=self._on_write_step,
        )
        commit.writer = writer
        extra = participant.manifest_extra()

        async def write() -> dict[str, Any]:
            # A thread is never interrupted, so the write cannot be cancelled half-way.
            manifest = await anyio.to_thread.run_sync(
                functools.partial(writer.write, records, extra=extra)
            )
            plane.telemetry.moved("commit", records=len(records), size=writer.bytes_written)
            return manifest

        return Job.start(plane.task_group, f"write of checkpoint {commit.checkpoint_id!r}", write)

    async def _export(self, commit: _Commit) -> list[Record]:
        plane = self._plane
        with checkpoint_span(EXPORT_SPAN, id=commit.checkpoint_id) as span:
            records = list(await plane.participant.export(commit.scope))
            set_checkpoint_attributes(span, records=len(records))
        # The scope as an index: a record naming a scoped attempt as a plain object is that
        # attempt, already validated (D425); anything else is validated and must be in scope.
        scope = None if commit.scope is None else RestoreScope.of(commit.scope)
        keys = set()
        for index, record in enumerate(records):
            raw = record.get("episode_id") if type(record) is dict else None
            episode = None if scope is None else scope.lookup(raw)
            if episode is None:
                episode = record_episode(record, index)
                if scope is not None and episode not in scope:
                    raise InvalidCheckpointStateError(
                        f"the participant exported {episode.capture_key}, which is outside the "
                        "scope"
                    )
            keys.add(episode.capture_key)
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
