"""The main process of a server with several processes (control-plane §4.6).

:class:`ProcessFanout` is a :class:`~participants.Participant` whose state lives in shard
processes: the main process runs a :class:`~participants.ControlPlane` over it, and every
participant operation fans out to the connected shards over their channels, replies merged.
Shards register, push readiness reports (close generation + sequence number), relay control
calls to the plane, and say ``stopping`` before a clean exit; :meth:`ProcessFanout.dispatch`
lists what the fan-out answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import SocketListener
from prometheus_client import generate_latest

from protocols import (
    AdmissionClosedError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InvalidRequestError,
    ParticipantKind,
)

from .._runtime.participant import Record
from .._runtime.plane import ControlPlane
from .channel import MESSAGE_TIMEOUT_SECONDS, Channel, Dispatch
from .drops import StaleCopies
from .messages import (
    Ask,
    CheckForget,
    Claim,
    Close,
    Control,
    DeleteRestored,
    ExportRecords,
    Forget,
    GatherMetrics,
    Health,
    Install,
    Marks,
    Open,
    Park,
    Register,
    Registered,
    Report,
    Retire,
    ServerHealth,
    ServerMetrics,
    ShardMetrics,
    Stopping,
)
from .placement import Placement, distinct_records, split_by_slot
from .relay import relay_control
from .roster import RosterMetrics, ShardRoster, ShardState

ReplyT = TypeVar("ReplyT")

_log = structlog.get_logger("midflight.fanout")


def plain_checkpoint_request(request: CheckpointRequest) -> CheckpointRequest:
    """The plain checkpoint request inside ``request`` (a restore's too)."""
    return CheckpointRequest.model_validate(
        request.model_dump(include=set(CheckpointRequest.model_fields))
    )


class ShardConnection:
    """One shard's connection, before and after it registers."""

    def __init__(self, channel: Channel, plane: ControlPlane) -> None:
        self.channel = channel
        self.plane = plane
        self.shard: ShardState | None = None

    def registered(self, kind: str) -> ShardState:
        """The shard of this connection.

        Raises:
            InvalidRequestError: It sent ``kind`` before ``register``.
        """
        if self.shard is None:
            raise InvalidRequestError(f"{kind} before register")
        return self.shard


class ProcessFanout(ShardRoster):
    """One participant made of ``expected`` shard processes: its operations, fanned out.

    Args:
        kind: The participant kind of the server.
        instance: The server name.
        expected: How many shard processes the server runs.
        placement: Where restored records go (:data:`~participants.Placement`).
    """

    def __init__(
        self,
        kind: ParticipantKind,
        instance: str,
        *,
        expected: int,
        placement: Placement = "slot",
    ) -> None:
        super().__init__(kind, instance, expected=expected)
        self.placement = placement
        self.claimed: dict[str, int] = {}
        """Restored keys claimed since the last install: capture key → the claiming shard."""
        self.stale_copies = StaleCopies(self._drop_restored)
        """The other shards' copies of what was claimed, dropped in batches (D393)."""
        self._manifest: dict[str, Any] | None = None
        self._metrics_registered = False

    # ----------------------------------------------------------------- connections

    async def serve(self, listener: SocketListener, plane: ControlPlane) -> None:
        """Accept shard connections for as long as the caller runs this."""
        if not self._metrics_registered:  # the roster scrapes on the control plane's /metrics
            plane.telemetry.registry.register(RosterMetrics(self))
            self._metrics_registered = True
        async with anyio.create_task_group() as group:
            while True:
                stream = await listener.accept()
                channel = Channel(stream, peer="a shard")
                group.start_soon(self._connection, ShardConnection(channel, plane))

    async def _connection(self, connection: ShardConnection) -> None:
        try:
            await connection.channel.serve(self.dispatch(connection))
        finally:
            shard = connection.shard
            if shard is not None and self.shards.get(shard.pid) is shard:
                self._drop(shard)

    def dispatch(self, connection: ShardConnection) -> Dispatch:
        """Every message the fan-out answers on ``connection``, and the handler of each.

        A specialised fan-out adds its own messages to this table.
        """
        return (
            Dispatch()
            .on(Register, partial(self._on_register, connection))
            .on(Report, partial(self._on_report, connection))
            .on(Stopping, partial(self._on_stopping, connection))
            .on(Claim, partial(self._on_claim, connection))
            .on(Control, partial(self._on_control, connection))
            .on(GatherMetrics, partial(self._on_gather_metrics, connection))
            .on(Health, partial(self._on_health, connection))
        )

    async def _on_register(self, connection: ShardConnection, message: Register) -> Registered:
        shard = connection.shard = ShardState(message.pid, message.slot, connection.channel)
        connection.channel.peer = f"shard {shard.pid}"
        self._join(shard)
        request = self.closed_request
        return Registered(
            generation=self.generation,
            request=None if request is None else plain_checkpoint_request(request),
            marks=dict(self.marks.snapshot()),
        )

    async def _on_report(self, connection: ShardConnection, message: Report) -> None:
        self._take_report(connection.registered(message.kind), message.readiness)

    async def _on_stopping(self, connection: ShardConnection, message: Stopping) -> None:
        connection.registered(message.kind).stopping = True

    async def _on_claim(self, connection: ShardConnection, message: Claim) -> bool:
        return await self._claim(connection.registered(message.kind), message.capture_key)

    async def _on_control(self, connection: ShardConnection, message: Control) -> dict[str, Any]:
        connection.registered(message.kind)
        return await relay_control(connection.plane, message)

    async def _on_gather_metrics(
        self, connection: ShardConnection, message: GatherMetrics
    ) -> ServerMetrics:
        connection.registered(message.kind)
        main = generate_latest(connection.plane.telemetry.registry).decode()
        return ServerMetrics(main=main, shards=await self.metrics())

    async def _on_health(self, connection: ShardConnection, message: Health) -> ServerHealth:
        connection.registered(message.kind)
        return self.health()

    # ----------------------------------------------------------------- fan-out

    async def _fan_out(
        self,
        message: Ask[ReplyT],
        *,
        within: float = MESSAGE_TIMEOUT_SECONDS,
        to: Sequence[ShardState] | None = None,
    ) -> dict[int, ReplyT]:
        """Send ``message`` to every shard (or ``to``) at once; pid → reply.

        Raises:
            WireError: The first refusal of any shard, with its code.
        """
        targets = list(self.shards.values()) if to is None else list(to)
        replies: dict[int, ReplyT] = {}
        errors: list[BaseException] = []

        async def one(shard: ShardState) -> None:
            try:
                replies[shard.pid] = await shard.channel.request(message, within=within)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as group:
            for shard in targets:
                group.start_soon(one, shard)
        if errors:
            raise errors[0]
        return replies

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Close every shard under a new generation; each close reply is its first report."""
        self.generation += 1
        self.closed_request = request
        self.lost_while_closed = []
        close = Close(request=plain_checkpoint_request(request), generation=self.generation)
        replies = await self._fan_out(close)
        for pid, readiness in replies.items():
            if pid in self.shards:
                self._take_report(self.shards[pid], readiness)

    async def open_admission(self) -> None:
        """Reopen every shard; a lost shard stops blocking."""
        self.closed_request = None
        self.lost_while_closed = []
        await self._fan_out(Open())
        self.changes.notify()

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Every shard's share of the parked work in scope, each distinct record once."""
        self._require_every_shard("export")
        scope = None if episode_ids is None else list(episode_ids)
        replies = await self._fan_out(ExportRecords(scope=scope))
        return distinct_records(replies[pid] for pid in sorted(replies))

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        """Kept, and handed to every shard with its part of the install."""
        self._manifest = manifest

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Each record on the shard of its rollout's slot; every shard sees the manifest.

        Waits (until the restore's deadline) for shards still joining.
        """
        await self.await_every_slot("restore")
        if self.served_live_work():
            raise CheckpointError("restore needs fresh processes: one has served live work")
        by_slot = split_by_slot(records, scope, self.expected)
        self.claimed = {}
        async with anyio.create_task_group() as group:
            for shard in list(self.shards.values()):
                share, share_scope = by_slot[shard.slot]
                if self.placement == "claim":
                    share, share_scope = list(records), list(scope)
                message = Install(records=share, scope=share_scope, manifest=self._manifest)
                group.start_soon(self._install_one, shard, message)

    async def _claim(self, shard: ShardState, capture_key: str) -> bool:
        """The first claim of a restored key wins; the other shards drop their copy first (in
        one message per shard for the claims that come together; D393)."""
        if self.closed_request is not None:
            raise AdmissionClosedError("a checkpoint is open; claim restored state after resume")
        owner = self.claimed.setdefault(capture_key, shard.pid)
        if owner != shard.pid:
            return False
        # The same shard asking again (its first answer lost, or its run refused after the
        # claim) is answered yes again, once the other copies are gone (D401).
        others = [pid for pid in self.shards if pid != shard.pid]
        episode = EpisodeId.from_capture_key(capture_key)
        await self.stale_copies.drop(others, episode)
        _log.info("shard.claimed", participant=self.instance, pid=shard.pid, key=capture_key)
        return True

    async def _drop_restored(self, pid: int, episodes: Sequence[EpisodeId]) -> None:
        shard = self.shards.get(pid)
        if shard is not None:  # one that left meanwhile took its copies with it
            await self._fan_out(DeleteRestored(episode_ids=list(episodes)), to=[shard])

    async def _install_one(self, shard: ShardState, message: Ask[None]) -> None:
        await shard.channel.request(message, within=MESSAGE_TIMEOUT_SECONDS * 4)

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Free the restored state of ``episode_id`` wherever it is."""
        await self._fan_out(DeleteRestored(episode_ids=[episode_id]))

    async def retire(self, episode_id: EpisodeId) -> None:
        """``retire_many`` of the one attempt."""
        await self.retire_many([episode_id])

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Every shard stops and frees the attempts, the whole batch in one message each
        (bounded by the runtime's deadline; D389)."""
        await self._fan_out(Retire(episode_ids=list(episode_ids)), within=3600.0)

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Send every shard the whole, current set of refusals (retire marks and restore fences).

        A shard only refuses; the fan-out's control plane is the one that counts the two apart
        in status, so the shards get them merged.
        """
        await self._fan_out(Marks(marks=dict(self.marks.snapshot())))

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        """Every shard accepts first, then every shard drops the marks."""
        await self._fan_out(CheckForget(rollout_ids=list(rollout_ids)))
        await self._fan_out(Forget(rollout_ids=list(rollout_ids)))

    async def park_exported(self, records: Sequence[Record]) -> None:
        """Each shard frees what its exported share holds."""
        await self._fan_out(Park())

    def manifest_extra(self) -> dict[str, Any]:
        """How many processes wrote the checkpoint (informational; the key is the manifest's)."""
        return {"workers": self.expected}

    async def metrics(self) -> list[str]:
        """Every shard's Prometheus text."""
        replies = await self._fan_out(ShardMetrics())
        return [replies[pid] for pid in sorted(replies)]
