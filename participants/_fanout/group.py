"""The per-server coordinator of a server with several worker processes (control-plane §4.6).

:class:`ProcessFanout` is a :class:`~participants.Participant` whose state lives in worker
processes: the main process runs a :class:`~participants.ControlPlane` over it, and every
participant operation fans out to the connected workers over their channels, replies merged.
Workers register, push readiness reports (close generation + sequence number), relay control
calls to the plane, and say ``stopping`` before a clean exit.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import anyio
import structlog
from anyio.abc import SocketListener
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError

from protocols import (
    MAX_REPORTED_BLOCKERS,
    AdmissionClosedError,
    CheckpointCoordinatorUnavailableError,
    CheckpointError,
    CheckpointRequest,
    CommitRequest,
    EpisodeId,
    ForgetRequest,
    InvalidCheckpointStateError,
    InvalidRequestError,
    ParticipantKind,
    PrepareReport,
    RestoreRequest,
    RetireRequest,
)

from .._runtime.participant import BaseParticipant, Record
from .._runtime.plane import ControlPlane
from .channel import MESSAGE_TIMEOUT_SECONDS, Channel

_log = structlog.get_logger("midflight.fanout")

CONTROL_BODIES: Final[dict[str, type[BaseModel] | None]] = {
    "status": None,
    "prepare": CheckpointRequest,
    "renew": CheckpointRequest,
    "commit": CommitRequest,
    "restore": RestoreRequest,
    "resume": CheckpointRequest,
    "retire": RetireRequest,
    "forget": ForgetRequest,
}
"""Control operations a worker may relay, and the body each one takes."""


Placement = Literal["slot", "claim"]
"""Where restored records go: ``slot`` — on the worker of the rollout's slot (state that spans
requests); ``claim`` — on every worker, used by the first that claims it (state inside one
request, such as an environment episode whose replacement ``/run`` lands on any worker)."""


def slot_of(rollout_id: str, workers: int) -> int:
    """The worker slot that owns ``rollout_id``: a stable hash, the same in every process."""
    digest = hashlib.sha256(rollout_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % workers


def checkpoint_request_json(request: CheckpointRequest) -> str:
    """The plain checkpoint request inside ``request`` (a restore's too), as JSON."""
    return request.model_dump_json(include=set(CheckpointRequest.model_fields))


@dataclass
class ShardState:
    """What the coordinator knows of one connected worker."""

    pid: int
    slot: int
    channel: Channel
    generation: int = -1
    seq: int = -1
    report: PrepareReport | None = None
    served: bool = False
    restored_pending: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    stopping: bool = False


class ProcessFanout(BaseParticipant):
    """One participant made of ``expected`` worker processes.

    Args:
        kind: The participant kind of the server.
        instance: The server name.
        expected: How many workers the server runs.
    """

    def __init__(
        self,
        kind: ParticipantKind,
        instance: str,
        *,
        expected: int,
        placement: Placement = "slot",
    ) -> None:
        super().__init__()
        if expected < 1:
            raise ValueError("a server needs at least one worker")
        self.kind = kind
        self.instance = instance
        self.expected = expected
        self.workers: dict[int, ShardState] = {}
        self.generation = 0
        self.closed_request: CheckpointRequest | None = None
        self.lost_while_closed: list[int] = []
        self.lost_since_start = 0
        self.placement = placement
        self.claimed: set[str] = set()
        self._manifest: dict[str, Any] | None = None

    # ----------------------------------------------------------------- connections

    async def serve(self, listener: SocketListener, plane: ControlPlane) -> None:
        """Accept worker connections for as long as the caller runs this."""
        async with anyio.create_task_group() as group:
            while True:
                stream = await listener.accept()
                group.start_soon(self._connection, Channel(stream, peer="worker"), plane)

    async def _connection(self, channel: Channel, plane: ControlPlane) -> None:
        worker: ShardState | None = None

        async def handle(kind: str, body: Any) -> Any:
            nonlocal worker
            if kind == "register":
                worker = ShardState(int(body["pid"]), int(body["slot"]), channel)
                channel.peer = f"worker {worker.pid}"
                return self._register(worker)
            if worker is None:
                raise InvalidRequestError(f"{kind} before register")
            if kind == "report":
                self._take_report(worker, body)
                return None
            if kind == "stopping":
                worker.stopping = True
                return None
            if kind == "claim":
                return await self._claim(worker, str(body["capture_key"]))
            if kind == "control":
                return await relay_control(plane, body)
            if kind == "metrics":
                own = generate_latest(plane.telemetry.registry).decode()
                return [own, *await self.metrics()]
            if kind == "health":
                return self.health()
            return await self.handle_message(worker, kind, body)

        try:
            await channel.serve(handle)
        finally:
            if worker is not None and self.workers.get(worker.pid) is worker:
                self._drop(worker)

    async def handle_message(self, worker: ShardState, kind: str, body: Any) -> Any:
        """A message kind of a specialised coordinator; none by default.

        Raises:
            InvalidRequestError: The kind is unknown.
        """
        raise InvalidRequestError(f"unknown message kind {kind!r}")

    def _register(self, worker: ShardState) -> dict[str, Any]:
        self.workers[worker.pid] = worker
        _log.info(
            "worker.joined",
            participant=self.instance,
            pid=worker.pid,
            slot=worker.slot,
            connected=len(self.workers),
            expected=self.expected,
            checkpoint_open=self.closed_request is not None,
        )
        self.changes.notify()
        request = self.closed_request
        return {
            "generation": self.generation,
            "request": None if request is None else checkpoint_request_json(request),
            "marks": dict(self.marks.snapshot()),
        }

    def _drop(self, worker: ShardState) -> None:
        del self.workers[worker.pid]
        if worker.stopping:
            _log.info("worker.stopped", participant=self.instance, pid=worker.pid, slot=worker.slot)
        else:
            self.lost_since_start += 1
            open_checkpoint = self.closed_request is not None
            if open_checkpoint:
                self.lost_while_closed.append(worker.pid)
            _log.warning(
                "worker.lost",
                participant=self.instance,
                pid=worker.pid,
                slot=worker.slot,
                remaining=len(self.workers),
                expected=self.expected,
                checkpoint_open=open_checkpoint,
                # Its share of the parked work is gone, so the open checkpoint cannot commit.
                open_checkpoint_can_commit=not open_checkpoint,
            )
        self.changes.notify()

    def _take_report(self, worker: ShardState, body: dict[str, Any]) -> None:
        generation, seq = int(body["generation"]), int(body["seq"])
        # Reports of an older close, or older than the newest we hold, describe a past state.
        if (generation, seq) <= (worker.generation, worker.seq):
            return
        worker.generation, worker.seq = generation, seq
        worker.report = PrepareReport.model_validate_json(body["report"])
        worker.served = bool(body["served"])
        worker.restored_pending = list(body["restored_pending"])
        worker.extra = dict(body["extra"])
        self.changes.notify()

    # ----------------------------------------------------------------- fan-out

    async def _fan_out(
        self,
        kind: str,
        body: Any,
        *,
        within: float = MESSAGE_TIMEOUT_SECONDS,
        to: Sequence[ShardState] | None = None,
    ) -> dict[int, Any]:
        """Send ``kind`` to every worker (or ``to``) at once; pid → reply body.

        Raises:
            MidflightError: The first refusal of any worker, with its code.
        """
        targets = list(self.workers.values()) if to is None else list(to)
        replies: dict[int, Any] = {}
        errors: list[BaseException] = []

        async def one(worker: ShardState) -> None:
            try:
                replies[worker.pid] = await worker.channel.request(kind, body, within=within)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as group:
            for worker in targets:
                group.start_soon(one, worker)
        if errors:
            raise errors[0]
        return replies

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Close every worker under a new generation; each close reply is its first report."""
        self.generation += 1
        self.closed_request = request
        self.lost_while_closed = []
        body = {"request": checkpoint_request_json(request), "generation": self.generation}
        replies = await self._fan_out("close", body)
        for pid, reply in replies.items():
            if pid in self.workers:
                self._take_report(self.workers[pid], reply)

    async def open_admission(self) -> None:
        """Reopen every worker; a lost worker stops blocking."""
        self.closed_request = None
        self.lost_while_closed = []
        await self._fan_out("open", None)
        self.changes.notify()

    def readiness(self) -> PrepareReport:
        """The workers' reports merged, with the blockers of unreported and lost workers."""
        closed = self.closed_request is not None
        reports = [
            w.report
            for w in self.workers.values()
            if w.report is not None and (not closed or w.generation == self.generation)
        ]
        blockers = sorted({b for report in reports for b in report.blockers})
        count = sum(report.blocker_count for report in reports)
        synthetic = []
        if closed:
            missing = self.expected - len(reports)
            if missing > 0:
                synthetic.append(f"{self.kind}-workers-unreported:{missing}")
            if self.lost_while_closed:
                synthetic.append(f"{self.kind}-worker-lost")
        counts: dict[str, int] = {}
        for report in reports:
            for name, value in report.counts.items():
                counts[name] = counts.get(name, 0) + value
        counts["workers"] = len(self.workers)
        return PrepareReport(
            ready=count + len(synthetic) == 0,
            blockers=sorted(synthetic + blockers)[:MAX_REPORTED_BLOCKERS],
            blocker_count=count + len(synthetic),
            counts=counts,
            restarts=sorted({r for report in reports for r in report.restarts}),
        )

    def ready(self) -> bool:
        """Whether the merged report has no blocker."""
        return self.readiness().ready

    def missing_slots(self) -> list[int]:
        """The slots no connected worker runs (a fresh server's workers join one by one)."""
        slots = {w.slot for w in self.workers.values()}
        return sorted(set(range(self.expected)) - slots)

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` reports: healthy once every slot has a worker (D244)."""
        missing = self.missing_slots()
        return {
            "ready": not missing,
            "workers": len(self.workers),
            "expected": self.expected,
            "missing_slots": missing,
        }

    async def await_every_slot(self, what: str) -> None:
        """Wait, until the open request's deadline, for a worker in every slot.

        A restore right after a fresh start may arrive while the last workers are still joining:
        that is a transient state, so it waits, and at the deadline it is a retryable refusal.

        Raises:
            CheckpointCoordinatorUnavailableError: A slot still has no worker at the deadline.
            InvalidCheckpointStateError: A worker was lost while the checkpoint was open.
        """
        request = self.closed_request
        deadline = request.deadline_ts if request is not None else time.time()
        while missing := self.missing_slots():
            remaining = deadline - time.time()
            if remaining <= 0:
                raise CheckpointCoordinatorUnavailableError(
                    f"{what}: no worker runs slot {missing} yet ({len(self.workers)} of "
                    f"{self.expected} joined); retry once every worker has joined"
                )
            seen = self.changes.version
            with anyio.move_on_after(min(remaining, 0.5)):
                await self.changes.wait_past(seen)
        self._require_every_worker(what)

    def _require_every_worker(self, what: str) -> None:
        if self.lost_while_closed:
            pids = ", ".join(str(pid) for pid in self.lost_while_closed)
            raise InvalidCheckpointStateError(
                f"{what}: worker {pids} was lost while the checkpoint was open; its share is gone"
            )
        missing = self.missing_slots()
        if missing:
            raise InvalidCheckpointStateError(f"{what}: no worker runs slot {missing}")

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Every worker's share of the parked work in scope."""
        self._require_every_worker("export")
        scope = None if episode_ids is None else [e.model_dump(mode="json") for e in episode_ids]
        replies = await self._fan_out("export", {"scope": scope})
        records: dict[str, Record] = {}
        for pid in sorted(replies):
            for record in replies[pid]:
                # Unclaimed restored records are held by every worker: carry each one once. The
                # key is the whole record, not its episode: one episode may hold several records
                # (a resources episode restored before its first boundary seeds a second session
                # beside the restored one), and keeping only the first lost the session the
                # episode went on with (five rollouts of `drill --rollouts 1000 --workers 2`).
                key = json.dumps(record, sort_keys=True)
                records.setdefault(key, record)
        return list(records.values())

    def served_live_work(self) -> bool:
        """Any worker served, or one was lost since start (what it held is unknown)."""
        return self.lost_since_start > 0 or any(w.served for w in self.workers.values())

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        """Kept, and handed to every worker with its share of the install."""
        self._manifest = manifest

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Each record on the worker of its rollout's slot; every worker sees the manifest.

        Waits (until the restore's deadline) for workers still joining.
        """
        await self.await_every_slot("restore")
        if self.served_live_work():
            raise CheckpointError("restore needs fresh workers: a worker has served live work")
        by_slot: dict[int, tuple[list[Record], list[Any]]] = {
            slot: ([], []) for slot in range(self.expected)
        }
        try:
            for record in records:
                episode = EpisodeId.model_validate(record["episode_id"])
                by_slot[slot_of(episode.rollout_id, self.expected)][0].append(record)
        except (KeyError, TypeError, ValidationError) as exc:
            raise InvalidCheckpointStateError(
                f"a record names no valid episode_id: {exc}"
            ) from None
        for episode in scope:
            by_slot[slot_of(episode.rollout_id, self.expected)][1].append(
                episode.model_dump(mode="json")
            )
        self.claimed = set()
        async with anyio.create_task_group() as group:
            for worker in list(self.workers.values()):
                share, share_scope = by_slot[worker.slot]
                if self.placement == "claim":
                    share = list(records)
                    share_scope = [e.model_dump(mode="json") for e in scope]
                body = {"records": share, "scope": share_scope, "manifest": self._manifest}
                group.start_soon(self._install_one, worker, body)

    async def _claim(self, worker: ShardState, capture_key: str) -> bool:
        """The first claim of a restored key wins; the other workers drop their copy."""
        if self.closed_request is not None:
            raise AdmissionClosedError("a checkpoint is open; claim restored state after resume")
        if capture_key in self.claimed:
            return False
        self.claimed.add(capture_key)
        others = [w for w in self.workers.values() if w is not worker]
        episode = EpisodeId.from_capture_key(capture_key).model_dump(mode="json")
        await self._fan_out("delete_restored", episode, to=others)
        _log.info("worker.claimed", participant=self.instance, pid=worker.pid, key=capture_key)
        return True

    async def _install_one(self, worker: ShardState, body: dict[str, Any]) -> None:
        await worker.channel.request("install", body, within=MESSAGE_TIMEOUT_SECONDS * 4)

    def restored_pending(self) -> list[EpisodeId]:
        """Every worker's restored attempts that have not started."""
        keys = sorted({k for w in self.workers.values() for k in w.restored_pending})
        return [EpisodeId.from_capture_key(key) for key in keys]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Free the restored state of ``episode_id`` wherever it is."""
        await self._fan_out("delete_restored", episode_id.model_dump(mode="json"))

    async def retire(self, episode_id: EpisodeId) -> None:
        """Every worker stops and frees the attempt (bounded by the runtime's deadline)."""
        await self._fan_out("retire", episode_id.model_dump(mode="json"), within=3600.0)

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Send every worker the whole, current set of refusals (retire marks and restore fences).

        A worker only refuses; the coordinator's control plane is the one that counts the two
        apart in status, so the workers get them merged.
        """
        await self._fan_out("marks", dict(self.marks.snapshot()))

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        """Every worker accepts first, then every worker drops the marks."""
        await self._fan_out("check_forget", list(rollout_ids))
        await self._fan_out("forget", list(rollout_ids))

    async def park_exported(self, records: Sequence[Record]) -> None:
        """Each worker frees what its exported share holds."""
        await self._fan_out("park", None)

    def status_extra(self) -> dict[str, Any]:
        """The workers' extra status fields: numbers summed, lists merged, the rest first seen."""
        merged: dict[str, Any] = {}
        for worker in sorted(self.workers.values(), key=lambda w: w.slot):
            for name, value in worker.extra.items():
                if name not in merged:
                    merged[name] = value
                elif isinstance(value, list):
                    merged[name] = sorted(set(merged[name]) | set(value))
                elif isinstance(value, int) and not isinstance(value, bool):
                    merged[name] += value
        return merged

    def manifest_extra(self) -> dict[str, Any]:
        """How many workers wrote the checkpoint (informational)."""
        return {"workers": self.expected}

    async def metrics(self) -> list[str]:
        """Every worker's Prometheus text."""
        replies = await self._fan_out("metrics", None)
        return [str(replies[pid]) for pid in sorted(replies)]


async def relay_control(plane: ControlPlane, body: dict[str, Any]) -> Any:
    """Run one control call a worker relayed; the reply body as JSON data."""
    operation = str(body.get("operation"))
    if operation not in CONTROL_BODIES:
        raise InvalidRequestError(f"unknown control operation {operation!r}")
    model = CONTROL_BODIES[operation]
    if model is None:
        return (await plane.status()).model_dump(mode="json")
    try:
        request = model.model_validate_json(body.get("body") or "")
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid"}
        location = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(f"{location or 'body'}: {first.get('msg')}") from None
    method = getattr(plane, operation)
    reply: BaseModel = await method(request)
    return json.loads(reply.model_dump_json())
