"""The control-plane runtime every participant embeds.

It owns the phase, the active checkpoint id, the lease, idempotent replay, the resumed-id memory,
retire marks and checkpoint storage; it reaches the participant only through
:class:`~participants.Participant`. One lock serializes every transition; prepare waits for
readiness outside it, so a resume can interrupt a waiting prepare.

Admission of a control call checks, in order: a resumed id (``stale_checkpoint``), another active
id (``checkpoint_conflict``), a stored result to replay, and the phase table (``invalid_phase``).
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup
from pydantic import BaseModel

from protocols import (
    ALLOWED_PHASES,
    DEFAULT_LEASE_GRACE_SECONDS,
    DEFAULT_MAX_DEADLINE_SECONDS,
    RESUMED_IDS_REMEMBERED,
    CheckpointConflictError,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    DeadlineExceededError,
    ForgetReply,
    ForgetRequest,
    InvalidPhaseError,
    Phase,
    PhaseEvent,
    PrepareReply,
    PrepareReport,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StaleCheckpointError,
    StatusReply,
    WireError,
    next_phase,
)

from ._clock import Clock, SystemClock, run_until, wait_until
from ._collector import COLLECTOR_PAUSE
from ._kill_points import KillPoint
from ._marks import RetireMarks
from ._participant import Participant
from ._restore_procedure import RestoreProcedure
from ._telemetry import ControlTelemetry
from ._transfer import CommitProcedure

R = TypeVar("R", bound=BaseModel)
Q = TypeVar("Q", bound=CheckpointRequest)


@dataclass(frozen=True, slots=True)
class ControlSettings:
    """Tunable limits of the control plane.

    Attributes:
        lease_grace_seconds: A lease lasts until ``deadline_ts`` plus this.
        max_deadline_seconds: The horizon: a ``deadline_ts`` further ahead is accepted and treated
            as this far ahead (the call's own work and the lease are bounded by it).
        resume_retry_seconds: After a lease expiry could not reopen, try again this much later.
        readiness_poll_seconds: A waiting prepare re-checks readiness at least this often.
        fence_on_restore: Whether a restore fences its scope (attempt N). Only the
            drill's ``no-restore-fence`` fault turns it off, to show that the drill notices.
        checkpoint_root: Every ``checkpoint_dir`` of a commit or restore must lie under this
            directory once ``..`` and symlinks are resolved (else ``invalid_request``, nothing
            changed); ``None`` accepts any absolute directory (a library user's own choice).
            Every reference server sets it (D240).
        pause_collector: Whether Python's cyclic garbage collector is paused while this plane is
            outside ``IDLE`` (D249): a full collection over a large heap would otherwise land
            inside the checkpoint's pause.
    """

    lease_grace_seconds: float = DEFAULT_LEASE_GRACE_SECONDS
    max_deadline_seconds: float = DEFAULT_MAX_DEADLINE_SECONDS
    resume_retry_seconds: float = 30.0
    readiness_poll_seconds: float = 1.0
    fence_on_restore: bool = True
    checkpoint_root: Path | None = None
    pause_collector: bool = True

    def __post_init__(self) -> None:
        for name in (
            "lease_grace_seconds",
            "max_deadline_seconds",
            "resume_retry_seconds",
            "readiness_poll_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


class ControlPlane:
    """Phases, lease, replay, marks and storage for one participant.

    Use ``async with plane.running():`` around serving (it runs the lease watcher and the jobs
    that may outlive a call), then call the operation methods, usually through the HTTP router.

    Args:
        participant: The participant whose work this control plane checkpoints.
        settings: Limits; the defaults of the reference when omitted.
        clock: Wall-clock time; inject a ``ManualClock`` in tests.
        telemetry: Metrics and logs; a fresh registry when omitted.
        on_write_step: Test hook passed to every ``RecordsWriter``.
        kill_point: The test-only named kill point of this server; by default read from the
            environment (inert unless ``MIDFLIGHT_TEST_HOOKS=1``), named by the instance.
    """

    def __init__(
        self,
        participant: Participant,
        *,
        settings: ControlSettings | None = None,
        clock: Clock | None = None,
        telemetry: ControlTelemetry | None = None,
        on_write_step: Callable[[str], None] | None = None,
        kill_point: KillPoint | None = None,
    ) -> None:
        self.participant = participant
        self.kill_point = kill_point or KillPoint(participant.instance)
        if on_write_step is None and self.kill_point.armed:
            on_write_step = self._write_step_kill_point
        self.settings = settings or ControlSettings()
        self.clock: Clock = clock or SystemClock()
        self.telemetry = telemetry or ControlTelemetry(participant.kind, participant.instance)
        self.marks = RetireMarks()
        participant.attach(self.marks)
        self.phase = Phase.IDLE
        self.checkpoint_id: str | None = None
        self.lease_expires_at: float | None = None
        self.lock = anyio.Lock()
        self._resumed: OrderedDict[str, None] = OrderedDict()
        self._results: dict[tuple[str, str], tuple[Hashable, BaseModel]] = {}
        self._lease_changed = anyio.Event()
        self._task_group: TaskGroup | None = None
        self.commits = CommitProcedure(self, on_write_step=on_write_step)
        self.restores = RestoreProcedure(self)

    # ----------------------------------------------------------------- lifecycle

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ControlPlane]:
        """Run the lease watcher and background jobs for as long as the block lasts."""
        async with anyio.create_task_group() as group:
            self._task_group = group
            group.start_soon(self._watch_lease, name="lease watcher")
            try:
                yield self
            finally:
                self._task_group = None
                self._hold_collector(self.phase is not Phase.IDLE, False)  # stopped mid-checkpoint
                group.cancel_scope.cancel()

    @property
    def task_group(self) -> TaskGroup:
        """Where jobs that may outlive a control call run."""
        if self._task_group is None:
            raise RuntimeError("the control plane is not running: use `async with plane.running()`")
        return self._task_group

    # ----------------------------------------------------------------- shared rules

    def bounded(self, request: Q) -> Q:
        """``request`` with its deadline capped at the horizon, ``max_deadline_seconds`` from now.

        Any finite deadline is accepted, as in the reference; this participant works under, and
        leases until, at most the horizon (plus the grace), so a far deadline from a controller
        that then died cannot keep admission closed for longer than that (D225).
        """
        horizon = self.clock.time() + self.settings.max_deadline_seconds
        if request.deadline_ts <= horizon:
            return request
        return request.model_copy(update={"deadline_ts": horizon})

    def admit(
        self, checkpoint_id: str, event: PhaseEvent, args: Hashable = None
    ) -> BaseModel | None:
        """The admission check; returns a stored result when the call is a replay."""
        if checkpoint_id in self._resumed:
            raise StaleCheckpointError(
                f"checkpoint {checkpoint_id!r} was resumed or its lease expired"
            )
        if self.checkpoint_id is not None and self.checkpoint_id != checkpoint_id:
            raise CheckpointConflictError(
                f"checkpoint {self.checkpoint_id!r} is active; {checkpoint_id!r} must wait"
            )
        stored = self._results.get((checkpoint_id, event.value))
        if stored is not None:
            stored_args, reply = stored
            if stored_args != args:
                raise CheckpointConflictError(
                    f"{event.value} of {checkpoint_id!r} already succeeded with other arguments"
                )
            return reply
        if self.phase not in ALLOWED_PHASES[event]:
            raise InvalidPhaseError(
                f"{event.value} is not allowed in phase {self.phase.value}"
                + (" (resume first)" if event in (PhaseEvent.RETIRE, PhaseEvent.FORGET) else "")
            )
        return None

    def store_result(self, checkpoint_id: str, event: PhaseEvent, args: Hashable, reply: R) -> R:
        """Remember a successful result for idempotent replay."""
        self._results[(checkpoint_id, event.value)] = (args, reply)
        return reply

    def transition(self, event: PhaseEvent) -> None:
        """Move along the phase table; outside ``IDLE`` the cyclic collector is paused (D249)."""
        before, self.phase = self.phase, next_phase(self.phase, event)
        self.telemetry.set_phase(self.phase)
        self._hold_collector(before is not Phase.IDLE, self.phase is not Phase.IDLE)

    def _hold_collector(self, held: bool, hold: bool) -> None:
        if not self.settings.pause_collector or held == hold:
            return
        if hold:
            COLLECTOR_PAUSE.hold()
        else:
            COLLECTOR_PAUSE.release()

    def renew_lease(self, deadline_ts: float) -> None:
        """Extend the lease to ``deadline_ts`` plus the grace; it never shrinks."""
        candidate = deadline_ts + self.settings.lease_grace_seconds
        if self.lease_expires_at is None or candidate > self.lease_expires_at:
            self.lease_expires_at = candidate
            self._wake_lease_watcher()

    def report(self) -> PrepareReport:
        """The participant's readiness report."""
        return self.participant.readiness()

    async def reopen(self, *, deadline: float, remember: bool = True) -> None:
        """End the active checkpoint: stop its writer, reopen admission, forget its results.

        Raises:
            DeadlineExceededError: Restored state is still being deleted; admission stays
                closed and the id is not remembered yet.
        """
        checkpoint_id = self.checkpoint_id
        await self.commits.abort(deadline)
        await self.participant.open_admission()
        if checkpoint_id is not None:
            if remember:
                self._remember_resumed(checkpoint_id)
            self._results = {k: v for k, v in self._results.items() if k[0] != checkpoint_id}
        if self.phase is not Phase.IDLE:
            self.transition(PhaseEvent.RESUME)
        self.checkpoint_id = None
        self.lease_expires_at = None
        self._wake_lease_watcher()
        self.participant.changes.notify()

    def _remember_resumed(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        self._resumed.move_to_end(checkpoint_id)
        while len(self._resumed) > RESUMED_IDS_REMEMBERED:
            self._resumed.popitem(last=False)

    # ----------------------------------------------------------------- lease

    def _wake_lease_watcher(self) -> None:
        self._lease_changed.set()
        self._lease_changed = anyio.Event()

    async def expire_lease_if_due(self) -> None:
        """Resume on our own when the active checkpoint's lease has run out (hold the lock)."""
        expires = self.lease_expires_at
        now = self.clock.time()
        if expires is None or self.phase is Phase.IDLE or now < expires:
            return
        checkpoint_id = self.checkpoint_id
        try:
            await self.reopen(deadline=now)
        except DeadlineExceededError:
            self.lease_expires_at = now + self.settings.resume_retry_seconds
            self._wake_lease_watcher()
            self.telemetry.event("lease_expired", checkpoint_id=checkpoint_id, reopened=False)
            return
        self.telemetry.event("lease_expired", checkpoint_id=checkpoint_id, reopened=True)

    async def _watch_lease(self) -> None:
        while True:
            changed = self._lease_changed
            expires = self.lease_expires_at
            if expires is None:
                await changed.wait()
                continue
            await wait_until(self.clock, expires, changed.wait)
            async with self.lock:
                await self.expire_lease_if_due()

    # ----------------------------------------------------------------- operations

    async def instrumented(
        self, operation: str, checkpoint_id: str | None, work: Callable[[], Awaitable[R]]
    ) -> R:
        """Run one operation and record its outcome (one event, counters, duration)."""
        started = time.perf_counter()
        try:
            reply = await work()
        except WireError as exc:
            self.telemetry.operation(
                operation,
                outcome="refused",
                code=exc.code,
                seconds=time.perf_counter() - started,
                checkpoint_id=checkpoint_id,
                phase=self.phase.value,
                detail=exc.detail,
            )
            raise
        except Exception:
            self.telemetry.operation(
                operation,
                outcome="error",
                code="internal_error",
                seconds=time.perf_counter() - started,
                checkpoint_id=checkpoint_id,
                phase=self.phase.value,
            )
            raise
        self.telemetry.operation(
            operation,
            outcome="ok",
            seconds=time.perf_counter() - started,
            checkpoint_id=checkpoint_id,
            phase=self.phase.value,
        )
        return reply

    async def status(self) -> StatusReply:
        """The participant's phase, lease, retire marks, restore fences and readiness."""

        async def work() -> StatusReply:
            async with self.lock:
                await self.expire_lease_if_due()
                return StatusReply.model_validate(
                    {
                        **self.participant.status_extra(),
                        "kind": self.participant.kind,
                        "instance": self.participant.instance,
                        "phase": self.phase,
                        "checkpoint_id": self.checkpoint_id,
                        "lease_expires_at": self.lease_expires_at,
                        "retired_rollouts": self.marks.retired_rollouts,
                        # An extra of every kind: restore fences are not retire marks (D223).
                        "restore_fences": self.marks.fenced_rollouts,
                        "report": self.report(),
                    }
                )

        return await work()

    def _write_step_kill_point(self, step: str) -> None:
        if step == "records_renamed":  # records durable under their name, no manifest yet
            self.kill_point.reach("records-written")

    async def prepare(self, request: CheckpointRequest) -> PrepareReply:
        """Close admission and wait, until the deadline, for every episode to park."""
        await self.kill_point.areach("prepare-sent")
        reply = await self.instrumented(
            "prepare", request.checkpoint_id, lambda: self._prepare(request)
        )
        if reply.phase is Phase.PREPARED:
            await self.kill_point.areach("some-prepared")  # prepared, the reply not yet sent
        return reply

    async def _prepare(self, request: CheckpointRequest) -> PrepareReply:
        request = self.bounded(request)
        checkpoint_id = request.checkpoint_id
        async with self.lock:
            await self.expire_lease_if_due()
            stored = self.admit(checkpoint_id, PhaseEvent.PREPARE)
            if self.phase is not Phase.IDLE:
                self.renew_lease(request.deadline_ts)
            if isinstance(stored, PrepareReply):
                return stored
            if self.phase is Phase.IDLE:
                self.checkpoint_id = checkpoint_id
                self.transition(PhaseEvent.PREPARE)
                self.renew_lease(request.deadline_ts)
                try:
                    await self.participant.close_admission(request)
                except BaseException:
                    await self._abandon_prepare()
                    raise
        regressed: int | None = None
        while True:
            try:
                if regressed is not None:  # wait for the change that may make it ready again
                    wake_at = min(
                        request.deadline_ts,
                        self.clock.time() + self.settings.readiness_poll_seconds,
                    )
                    changes = self.participant.changes
                    await wait_until(
                        self.clock, wake_at, functools.partial(changes.wait_past, regressed)
                    )
                await self._wait_ready(checkpoint_id, request.deadline_ts)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    async with self.lock:
                        if self.checkpoint_id == checkpoint_id and self.phase is Phase.PREPARING:
                            await self._abandon_prepare()
                raise
            async with self.lock:
                if self.checkpoint_id != checkpoint_id:
                    return PrepareReply(phase=self.phase, report=self.report())
                replay = self._results.get((checkpoint_id, PhaseEvent.PREPARE.value))
                if replay is not None and isinstance(replay[1], PrepareReply):
                    return replay[1]
                if self.phase is not Phase.PREPARING:
                    return PrepareReply(phase=self.phase, report=self.report())
                report = self.report()
                if report.ready:
                    self.transition(PhaseEvent.READY)
                    reply = PrepareReply(phase=self.phase, report=report)
                    return self.store_result(checkpoint_id, PhaseEvent.PREPARE, None, reply)
                if self.clock.time() < request.deadline_ts:
                    # Readiness regressed between the wait and the lock (a restored episode
                    # admitted meanwhile, say): only the deadline ends a prepare not ready (D218).
                    regressed = self.participant.changes.version
                    continue
                self.telemetry.event(
                    "prepare_not_ready",
                    checkpoint_id=checkpoint_id,
                    blocker_count=report.blocker_count,
                    blockers=report.blockers[:10],
                )
                return PrepareReply(phase=self.phase, report=report)

    async def _abandon_prepare(self) -> None:
        """A close or readiness wait failed: reopen; the id may try again."""
        await self.participant.open_admission()
        self.transition(PhaseEvent.RESUME)
        self.checkpoint_id = None
        self.lease_expires_at = None
        self._wake_lease_watcher()

    async def _wait_ready(self, checkpoint_id: str, deadline: float) -> None:
        changes = self.participant.changes
        while self.checkpoint_id == checkpoint_id and self.phase is Phase.PREPARING:
            seen = changes.version
            if self.participant.ready():
                return
            now = self.clock.time()
            if now >= deadline:
                return
            wake_at = min(deadline, now + self.settings.readiness_poll_seconds)
            await wait_until(self.clock, wake_at, functools.partial(changes.wait_past, seen))

    async def commit(self, request: CommitRequest) -> CommitReply:
        """Export the parked work once and publish it (see ``CommitProcedure``)."""
        reply = await self.instrumented(
            "commit", request.checkpoint_id, lambda: self.commits.run(request)
        )
        await self.kill_point.areach("manifests-published")  # published, the reply not yet sent
        return reply

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        """Install a checkpoint's records under their next attempts (see ``RestoreProcedure``)."""
        return await self.instrumented(
            "restore", request.checkpoint_id, lambda: self.restores.run(request)
        )

    async def resume(self, request: CheckpointRequest) -> ResumeReply:
        """Reopen admission, whether or not the checkpoint was published (resume is abort)."""
        await self.kill_point.areach("resume-partly-sent")  # received, not applied
        return await self.instrumented(
            "resume", request.checkpoint_id, lambda: self._resume(request)
        )

    async def _resume(self, request: CheckpointRequest) -> ResumeReply:
        request = self.bounded(request)
        checkpoint_id = request.checkpoint_id
        async with self.lock:
            await self.expire_lease_if_due()
            if checkpoint_id in self._resumed:
                return ResumeReply(phase=Phase.IDLE, idempotent=True)
            if self.phase is Phase.IDLE and self.checkpoint_id is None:
                # A prepare for this id never arrived; make sure a late one cannot close us.
                self._remember_resumed(checkpoint_id)
                return ResumeReply(phase=Phase.IDLE, idempotent=True)
            if self.checkpoint_id != checkpoint_id:
                raise CheckpointConflictError(
                    f"checkpoint {self.checkpoint_id!r} is active, not {checkpoint_id!r}"
                )
            await self.reopen(deadline=request.deadline_ts)
            return ResumeReply(phase=Phase.IDLE, idempotent=False)

    async def renew(self, request: CheckpointRequest) -> RenewReply:
        """Extend the lease of the active checkpoint."""
        return await self.instrumented("renew", request.checkpoint_id, lambda: self._renew(request))

    async def _renew(self, request: CheckpointRequest) -> RenewReply:
        request = self.bounded(request)
        async with self.lock:
            await self.expire_lease_if_due()
            self.admit(request.checkpoint_id, PhaseEvent.RENEW)
            self.renew_lease(request.deadline_ts)
            assert self.lease_expires_at is not None
            return RenewReply(lease_expires_at=self.lease_expires_at)

    def _admit_retire_or_forget(self, checkpoint_id: str, event: PhaseEvent) -> None:
        # Outside an open checkpoint the id is only a label, so no stale-id check applies.
        if self.phase not in ALLOWED_PHASES[event]:
            raise InvalidPhaseError(
                f"{event.value} is refused while checkpoint {self.checkpoint_id!r} is open "
                f"(phase {self.phase.value}); resume first"
            )
        if self.phase is Phase.RESTORED and checkpoint_id != self.checkpoint_id:
            raise CheckpointConflictError(
                f"restore {self.checkpoint_id!r} is active; retire under its id or resume first"
            )

    async def retire(self, request: RetireRequest) -> RetireReply:
        """Refuse, stop, then free the named attempts and every earlier one."""
        reply = await self.instrumented(
            "retire", request.checkpoint_id, lambda: self._retire(request)
        )
        await self.kill_point.areach("retire-partly-applied")  # applied, the reply not yet sent
        return reply

    async def _retire(self, request: RetireRequest) -> RetireReply:
        request = self.bounded(request)
        deadline = request.deadline_ts
        async with self.lock:
            await self.expire_lease_if_due()
            self._admit_retire_or_forget(request.checkpoint_id, PhaseEvent.RETIRE)
            if self.phase is Phase.RESTORED:
                self.renew_lease(deadline)
            self.marks.raise_to(request.episode_ids)
            await run_until(
                self.clock,
                deadline,
                lambda: self.participant.mark_retired(request.episode_ids),
                what="retire marks to propagate",
            )
        await self.restores.wait_for_install(deadline)
        for episode in request.episode_ids:
            await run_until(
                self.clock,
                deadline,
                functools.partial(self.participant.retire, episode),
                what=f"{episode.capture_key} to stop",
            )
        self.participant.changes.notify()
        return RetireReply(retired=[episode.capture_key for episode in request.episode_ids])

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        """Remove the retire marks of rollouts that are finished for good."""
        return await self.instrumented(
            "forget", request.checkpoint_id, lambda: self._forget(request)
        )

    async def _forget(self, request: ForgetRequest) -> ForgetReply:
        request = self.bounded(request)
        rollout_ids = sorted(set(request.rollout_ids))
        async with self.lock:
            await self.expire_lease_if_due()
            self._admit_retire_or_forget(request.checkpoint_id, PhaseEvent.FORGET)
            if self.phase is Phase.RESTORED:
                self.renew_lease(request.deadline_ts)
            await run_until(
                self.clock,
                request.deadline_ts,
                lambda: self.participant.forget(rollout_ids),
                what="the participant to accept forget",
            )
            self.marks.forget(rollout_ids)
        return ForgetReply(forgotten=rollout_ids)

    def results_snapshot(self) -> dict[tuple[str, str], Any]:
        """Stored replay results (for tests and status tooling)."""
        return {key: reply for key, (_args, reply) in self._results.items()}
