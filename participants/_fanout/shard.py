"""The worker end of a server with several worker processes (control-plane §4.6).

A :class:`FanoutShard` connects the worker's own participant to the coordinator in the main
process: it registers (adopting an open checkpoint and the retire marks at once), answers the
coordinator's fan-out messages by calling the local participant, pushes readiness reports
whenever they change (close generation + sequence number), relays the control calls this worker
receives over HTTP, and says ``stopping`` before a clean exit. A worker that loses its
coordinator sends itself SIGTERM: serving on without a control plane would be unsafe.
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

from protocols import CheckpointRequest, EpisodeId, InvalidRequestError, MidflightError

from .._runtime.participant import Record
from .._runtime.plane import ControlPlane
from .channel import MESSAGE_TIMEOUT_SECONDS, REPLY_GRACE_SECONDS, Channel, connect

REPORT_POLL_SECONDS: Final = 0.5
"""How often a worker re-checks its readiness for a change to push (also woken by changes)."""
HEALTH_TIMEOUT_SECONDS: Final = 5.0
"""A health check never hangs on a busy coordinator for long."""
STOPPING_TIMEOUT_SECONDS: Final = 2.0
"""A clean stop tells the coordinator first, but never waits long for its answer."""

_log = structlog.get_logger("midflight.fanout")


def _default_on_lost() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class FanoutShard:
    """One worker process's participant, served to the coordinator.

    Args:
        plane: The worker's local control plane: its participant and the retire marks the data
            plane checks (its control operations are never called: the coordinator's are).
        slot: The worker's slot (which rollouts it owns).
        socket_path: The coordinator's Unix socket.
        on_fanout_lost: What to do when the channel closes unasked; SIGTERM to self.
        pid: How the coordinator names this worker; the process id unless a test sets it.
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
        if hasattr(self.participant, "claim_restored"):
            # Restored state that lives inside one request: the first worker to use it claims it.
            self.participant.claim_restored = self.claim
        if hasattr(self.participant, "claim_cut"):
            # The model server's restored cuts stay with the coordinator until a call claims one.
            model: Any = self.participant
            model.claim_cut = self.claim_cut
            model.return_cut = self.return_cut

    @property
    def channel(self) -> Channel:
        """The connection to the coordinator (while running)."""
        if self._channel is None:
            raise RuntimeError("the worker is not connected: use `async with member.running()`")
        return self._channel

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FanoutShard]:
        """Connect and register, serve the coordinator while the block runs, then stop cleanly."""
        channel = await connect(self.socket_path)
        self._channel = channel
        async with anyio.create_task_group() as group:
            group.start_soon(self._serve, channel)
            reply = await channel.request(
                "register",
                {"pid": self.pid, "slot": self.slot},
                within=MESSAGE_TIMEOUT_SECONDS,
            )
            await self._adopt(reply)
            group.start_soon(self._push_reports)
            try:
                yield self
            finally:
                self._stopping = True
                # The coordinator may be gone already: then there is nobody to tell.
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(STOPPING_TIMEOUT_SECONDS),
                    contextlib.suppress(MidflightError),
                ):
                    await channel.request(
                        "stopping", {"pid": self.pid}, within=STOPPING_TIMEOUT_SECONDS
                    )
                group.cancel_scope.cancel()

    async def _serve(self, channel: Channel) -> None:
        await channel.serve(self._handle)
        if not self._stopping:
            _log.warning("worker.coordinator_lost", pid=self.pid, slot=self.slot)
            self.on_fanout_lost()

    async def _adopt(self, reply: dict[str, Any]) -> None:
        """Take the retire marks and, while a checkpoint is open, close at once."""
        await self._set_marks(reply["marks"])
        request = reply.get("request")
        if request is not None and int(reply["generation"]) >= self.generation:
            await self._close(CheckpointRequest.model_validate_json(request), reply["generation"])
            await self._send_report()

    async def _set_marks(self, marks: dict[str, int]) -> None:
        episodes = [EpisodeId(rollout_id=r, attempt=int(a)) for r, a in sorted(marks.items())]
        self.plane.marks.raise_to(episodes)
        if episodes:
            await self.participant.mark_retired(episodes)

    async def _close(self, request: CheckpointRequest, generation: int) -> None:
        self.generation = int(generation)
        self.closed = True
        await self.participant.close_admission(request)

    # ----------------------------------------------------------------- reports

    def _state(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "report": self.participant.readiness().model_dump_json(),
            "served": self.participant.served_live_work(),
            "restored_pending": [e.capture_key for e in self.participant.restored_pending()],
            "extra": self.participant.status_extra(),
        }

    def _report(self) -> dict[str, Any]:
        self._seq += 1
        return {**self._state(), "seq": self._seq}

    async def _send_report(self) -> None:
        await self.channel.request("report", self._report(), within=MESSAGE_TIMEOUT_SECONDS)

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
                        "report",
                        {**state, "seq": self._next_seq()},
                        within=MESSAGE_TIMEOUT_SECONDS,
                    )
                except MidflightError:
                    return  # the channel is gone; _serve decides what happens next
            with anyio.move_on_after(REPORT_POLL_SECONDS):
                await changes.wait_past(seen)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ----------------------------------------------------------------- coordinator messages

    async def _handle(self, kind: str, body: Any) -> Any:
        participant = self.participant
        if kind == "close":
            await self._close(
                CheckpointRequest.model_validate_json(body["request"]), body["generation"]
            )
            return self._report()
        if kind == "open":
            self.closed = False
            await participant.open_admission()
            return None
        if kind == "marks":
            await self._set_marks(body)
            return None
        if kind == "retire":
            await participant.retire(EpisodeId.model_validate(body))
            return None
        if kind == "delete_restored":
            await participant.delete_restored(EpisodeId.model_validate(body))
            return None
        if kind == "check_forget":
            await participant.forget(list(body))
            return None
        if kind == "forget":
            self.plane.marks.forget(list(body))
            return None
        if kind == "export":
            scope = body["scope"]
            episodes = None if scope is None else [EpisodeId.model_validate(e) for e in scope]
            share = getattr(participant, "export_share", None)
            if share is not None:
                # A share the coordinator merges (the model's: undelivered calls of every worker).
                return await share(episodes)
            self._exported = list(await participant.export(episodes))
            return self._exported
        if kind == "install":
            if body.get("manifest") is not None:
                participant.restore_manifest(body["manifest"])
            scope = [EpisodeId.model_validate(e) for e in body["scope"]]
            install_share = getattr(participant, "install_share", None)
            if body.get("options") is not None and install_share is not None:
                # A share of a specialised coordinator's restore (the model's: import once).
                await install_share(body["records"], scope, body["options"])
                return None
            await participant.install(body["records"], scope)
            return None
        if kind == "park":
            await participant.park_exported(self._exported)
            return None
        if kind == "metrics":
            return generate_latest(self.plane.telemetry.registry).decode()
        raise InvalidRequestError(f"unknown message kind {kind!r}")

    async def claim(self, capture_key: str) -> bool:
        """Ask the coordinator for the restored state of ``capture_key``; whether it is ours."""
        reply = await self.channel.request(
            "claim", {"capture_key": capture_key}, within=MESSAGE_TIMEOUT_SECONDS
        )
        return bool(reply)

    async def claim_cut(self, capture_key: str, request_digest: str) -> dict[str, Any] | None:
        """Ask the coordinator for the restored cut of ``capture_key`` this request continues."""
        reply = await self.channel.request(
            "claim_cut",
            {"capture_key": capture_key, "request_digest": request_digest},
            within=MESSAGE_TIMEOUT_SECONDS,
        )
        return None if reply is None else dict(reply)

    async def return_cut(self, capture_key: str, record: dict[str, Any]) -> None:
        """Give back a claimed cut no response used, so the next checkpoint carries it."""
        await self.channel.request(
            "return_cut",
            {"capture_key": capture_key, "record": record},
            within=MESSAGE_TIMEOUT_SECONDS,
        )

    # ----------------------------------------------------------------- control relay

    async def health(self) -> dict[str, Any]:
        """The server's health as the coordinator sees it (every slot joined, or not)."""
        reply: dict[str, Any] = await self.channel.request(
            "health", None, within=HEALTH_TIMEOUT_SECONDS
        )
        return reply

    async def relay_control(self, operation: str, raw_body: bytes) -> Any:
        """Relay one control call to the coordinator; its reply body (or its typed error).

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
        return await self.channel.request(
            "control", {"operation": operation, "body": text}, within=within
        )
