"""The shard end of a server with several processes (control-plane §4.6).

A :class:`FanoutShard` connects the shard process's own participant to the fan-out in the main
process: it registers (adopting an open checkpoint and the retire marks at once), answers the
fan-out's messages by calling the local participant (one handler per message type, see
:meth:`FanoutShard.dispatch`), pushes readiness reports whenever they change (close generation +
sequence number), relays the control calls this process receives over HTTP, and says
``stopping`` before a clean exit. A shard that loses the fan-out sends itself SIGTERM: serving on
without a control plane would be unsafe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import structlog
from prometheus_client import generate_latest

from protocols import CheckpointRequest, EpisodeId, WireError

from .._runtime.participant import Record
from .._runtime.plane import ControlPlane
from .capabilities import ClaimsCuts, ClaimsRestored, ExportsShares
from .channel import MESSAGE_TIMEOUT_SECONDS, REPLY_GRACE_SECONDS, Channel, Dispatch, connect
from .messages import (
    CheckForget,
    Claim,
    ClaimCut,
    Close,
    Control,
    DeleteRestored,
    ExportRecords,
    ExportShare,
    Forget,
    GatherMetrics,
    Health,
    Install,
    InstallShare,
    Marks,
    ModelShare,
    Open,
    Park,
    Readiness,
    Register,
    Registered,
    Report,
    Retire,
    ReturnCut,
    ServerHealth,
    ServerMetrics,
    ShardMetrics,
    Stopping,
)

REPORT_POLL_SECONDS: Final = 0.5
"""How often a shard re-checks its readiness for a change to push (also woken by changes)."""
HEALTH_TIMEOUT_SECONDS: Final = 5.0
"""A health check never hangs on a busy fan-out for long."""
METRICS_TIMEOUT_SECONDS: Final = 30.0
"""Gathering every process's metrics waits for every shard's reply."""
STOPPING_TIMEOUT_SECONDS: Final = 2.0
"""A clean stop tells the fan-out first, but never waits long for its answer."""

_log = structlog.get_logger("midflight.fanout")


def _default_on_lost() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class FanoutShard:
    """One shard process's participant, served to the fan-out.

    Args:
        plane: The shard's local control plane: its participant and the retire marks the data
            plane checks (its control operations are never called: the fan-out's are).
        slot: The shard's slot (which rollouts it owns).
        socket_path: The fan-out's Unix socket.
        on_fanout_lost: What to do when the channel closes unasked; SIGTERM to self.
        pid: How the fan-out names this shard; the process id unless a test sets it.
    """

    def __init__(
        self,
        plane: ControlPlane,
        *,
        slot: int,
        socket_path: Path | str,
        on_fanout_lost: Callable[[], None] = _default_on_lost,
        pid: int | None = None,
    ) -> None:
        self.plane = plane
        self.participant = plane.participant
        self.slot = slot
        self.pid = os.getpid() if pid is None else pid
        self.socket_path = socket_path
        self.on_fanout_lost = on_fanout_lost
        self.generation = 0
        self.closed = False
        self._seq = 0
        self._exported: list[Record] = []
        self._stopping = False
        self._channel: Channel | None = None
        participant = self.participant
        self.shares: ExportsShares | None = (
            participant if isinstance(participant, ExportsShares) else None
        )
        """The participant's share capability (the model's), or ``None``."""
        if isinstance(participant, ClaimsRestored):
            # Restored state that lives inside one request: the first shard to use it claims it.
            participant.claim_restored = self.claim
        if isinstance(participant, ClaimsCuts):
            # The model server's restored cuts stay with the fan-out until a call claims one.
            participant.claim_cut = self.claim_cut
            participant.return_cut = self.return_cut

    @property
    def channel(self) -> Channel:
        """The connection to the fan-out (while running)."""
        if self._channel is None:
            raise RuntimeError("the shard is not connected: use `async with shard.running()`")
        return self._channel

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FanoutShard]:
        """Connect and register, serve the fan-out while the block runs, then stop cleanly."""
        channel = await connect(self.socket_path)
        self._channel = channel
        async with anyio.create_task_group() as group:
            group.start_soon(self._serve, channel)
            registered = await channel.request(
                Register(pid=self.pid, slot=self.slot), within=MESSAGE_TIMEOUT_SECONDS
            )
            await self._adopt(registered)
            group.start_soon(self._push_reports)
            try:
                yield self
            finally:
                self._stopping = True
                # The fan-out may be gone already: then there is nobody to tell.
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(STOPPING_TIMEOUT_SECONDS),
                    contextlib.suppress(WireError),
                ):
                    await channel.request(Stopping(pid=self.pid), within=STOPPING_TIMEOUT_SECONDS)
                group.cancel_scope.cancel()

    async def _serve(self, channel: Channel) -> None:
        await channel.serve(self.dispatch())
        if not self._stopping:
            _log.warning("shard.fanout_lost", pid=self.pid, slot=self.slot)
            self.on_fanout_lost()

    async def _adopt(self, registered: Registered) -> None:
        """Take the retire marks and, while a checkpoint is open, close at once."""
        await self._set_marks(registered.marks)
        if registered.request is not None and registered.generation >= self.generation:
            await self._close(registered.request, registered.generation)
            await self._send_report()

    async def _set_marks(self, marks: dict[str, int]) -> None:
        episodes = [EpisodeId(rollout_id=r, attempt=a) for r, a in sorted(marks.items())]
        self.plane.marks.raise_to(episodes)
        if episodes:
            await self.participant.mark_retired(episodes)

    async def _close(self, request: CheckpointRequest, generation: int) -> None:
        self.generation = generation
        self.closed = True
        await self.participant.close_admission(request)

    # ----------------------------------------------------------------- reports

    def _state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "report": self.participant.readiness(),
            "served": self.participant.served_live_work(),
            "restored_pending": [e.capture_key for e in self.participant.restored_pending()],
            "extra": self.participant.status_extra(),
        }

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _readiness(self, state: dict[str, Any] | None = None) -> Readiness:
        return Readiness(**(state or self._state()), seq=self._next_seq())

    async def _send_report(self) -> None:
        await self.channel.request(
            Report(readiness=self._readiness()), within=MESSAGE_TIMEOUT_SECONDS
        )

    async def _push_reports(self) -> None:
        """Push the readiness report whenever it changes (woken by changes, polled besides)."""
        last: dict[str, Any] | None = None
        changes = self.participant.changes
        while True:
            seen = changes.version
            state = self._state()
            if state != last:
                last = state
                try:
                    await self.channel.request(
                        Report(readiness=self._readiness(state)), within=MESSAGE_TIMEOUT_SECONDS
                    )
                except WireError:
                    return  # the channel is gone; _serve decides what happens next
            with anyio.move_on_after(REPORT_POLL_SECONDS):
                await changes.wait_past(seen)

    # ----------------------------------------------------------------- the fan-out's messages

    def dispatch(self) -> Dispatch:
        """Every message a shard answers, and the handler of each.

        ``export_share`` and ``install_share`` only when the participant exports shares; any
        other message is refused with ``invalid_request``.
        """
        table = (
            Dispatch()
            .on(Close, self._on_close)
            .on(Open, self._on_open)
            .on(Marks, self._on_marks)
            .on(Retire, self._on_retire)
            .on(DeleteRestored, self._on_delete_restored)
            .on(CheckForget, self._on_check_forget)
            .on(Forget, self._on_forget)
            .on(ExportRecords, self._on_export_records)
            .on(Install, self._on_install)
            .on(Park, self._on_park)
            .on(ShardMetrics, self._on_metrics)
        )
        if self.shares is not None:
            table.on(ExportShare, self._on_export_share).on(InstallShare, self._on_install_share)
        return table

    async def _on_close(self, message: Close) -> Readiness:
        await self._close(message.request, message.generation)
        return self._readiness()

    async def _on_open(self, message: Open) -> None:
        self.closed = False
        await self.participant.open_admission()

    async def _on_marks(self, message: Marks) -> None:
        await self._set_marks(message.marks)

    async def _on_retire(self, message: Retire) -> None:
        await self.participant.retire_many(message.episode_ids)

    async def _on_delete_restored(self, message: DeleteRestored) -> None:
        for episode_id in message.episode_ids:
            await self.participant.delete_restored(episode_id)

    async def _on_check_forget(self, message: CheckForget) -> None:
        await self.participant.forget(message.rollout_ids)

    async def _on_forget(self, message: Forget) -> None:
        self.plane.marks.forget(message.rollout_ids)

    async def _on_export_records(self, message: ExportRecords) -> list[Record]:
        self._exported = list(await self.participant.export(message.scope))
        return self._exported

    async def _on_install(self, message: Install) -> None:
        if message.manifest is not None:
            self.participant.restore_manifest(message.manifest)
        await self.participant.install(message.records, message.scope)

    async def _on_park(self, message: Park) -> None:
        await self.participant.park_exported(self._exported)

    async def _on_metrics(self, message: ShardMetrics) -> str:
        return generate_latest(self.plane.telemetry.registry).decode()

    async def _on_export_share(self, message: ExportShare) -> ModelShare:
        assert self.shares is not None  # only in the table with the capability
        return ModelShare.model_validate(await self.shares.export_share(message.scope))

    async def _on_install_share(self, message: InstallShare) -> None:
        assert self.shares is not None  # only in the table with the capability
        if message.manifest is not None:
            self.participant.restore_manifest(message.manifest)
        options = {
            "import": message.import_ledger,
            "targets": message.targets,
            "cut_keys": message.cut_keys,
        }
        await self.shares.install_share(message.records, message.scope, options)

    # ----------------------------------------------------------------- asking the fan-out

    async def claim(self, capture_key: str) -> bool:
        """Ask the fan-out for the restored state of ``capture_key``; whether it is ours."""
        return await self.channel.request(
            Claim(capture_key=capture_key), within=MESSAGE_TIMEOUT_SECONDS
        )

    async def claim_cut(self, capture_key: str, request_digest: str) -> dict[str, Any] | None:
        """Ask the fan-out for the restored cut of ``capture_key`` this request continues."""
        record = await self.channel.request(
            ClaimCut(capture_key=capture_key, request_digest=request_digest),
            within=MESSAGE_TIMEOUT_SECONDS,
        )
        return None if record is None else record.model_dump(mode="json")

    async def return_cut(self, capture_key: str, record: dict[str, Any]) -> None:
        """Give back a claimed cut no response used, so the next checkpoint carries it."""
        await self.channel.request(
            ReturnCut.model_validate({"capture_key": capture_key, "record": record}),
            within=MESSAGE_TIMEOUT_SECONDS,
        )

    async def gather_metrics(self) -> ServerMetrics:
        """Every process's Prometheus text, for this shard's ``/metrics``."""
        return await self.channel.request(GatherMetrics(), within=METRICS_TIMEOUT_SECONDS)

    async def health(self) -> ServerHealth:
        """The server's health as the fan-out sees it (every slot taken, or not)."""
        return await self.channel.request(Health(), within=HEALTH_TIMEOUT_SECONDS)

    async def relay_control(self, operation: str, raw_body: bytes) -> dict[str, Any]:
        """Relay one control call to the fan-out; its reply body (or its typed error).

        The reply is awaited until the call's own ``deadline_ts`` plus a grace, so a prepare
        that waits for readiness is not cut short by the channel.
        """
        within = MESSAGE_TIMEOUT_SECONDS
        text = raw_body.decode(errors="replace")
        try:
            deadline = json.loads(text).get("deadline_ts") if text else None
        except (ValueError, AttributeError):
            deadline = None
        if isinstance(deadline, int | float):
            within = max(within, float(deadline) - time.time() + REPLY_GRACE_SECONDS)
        return await self.channel.request(Control(operation=operation, body=text), within=within)
