"""The private channel between a server's coordinator and its worker processes.

One Unix-socket connection per worker carries requests and replies in both directions. A frame is
a 4-byte big-endian length followed by compact JSON, at most :data:`FRAME_MAX_BYTES`. A request is
``{"id", "kind", "body"}``; its reply ``{"reply_to", "ok": true, "body"}`` or ``{"reply_to",
"ok": false, "error": {"status", "code", "detail"}}``, so a typed error crosses the channel with its
status and code. Every wait for a reply has a deadline.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import anyio
import structlog
from anyio.abc import ByteStream, SocketListener
from anyio.streams.buffered import BufferedByteReceiveStream

from protocols import (
    CheckpointCoordinatorUnavailableError,
    InvalidCheckpointStateError,
    MidflightError,
    error_from_envelope,
)

FRAME_MAX_BYTES: Final = 64 * 1024 * 1024
"""The largest frame either side sends or accepts (a whole share of records fits)."""
MESSAGE_TIMEOUT_SECONDS: Final = 30.0
"""How long a light message (close, open, marks, report …) waits for its reply."""
REPLY_GRACE_SECONDS: Final = 10.0
"""How long past a control call's own deadline its relayed reply is waited for."""
SOCKET_ENV: Final = "MIDFLIGHT_WORKER_SOCKET"
"""The environment variable naming the coordinator's socket path in every worker."""

Handler = Callable[[str, Any], Awaitable[Any]]
"""Answers one request: ``(kind, body) -> reply body``; raises a ``MidflightError`` to refuse."""

_log = structlog.get_logger("midflight.workers")
_HEADER = struct.Struct(">I")


class _Pending:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.body: Any = None
        self.error: MidflightError | None = None


class Channel:
    """One end of a worker connection.

    Args:
        stream: The connected Unix socket stream.
        peer: How log lines and errors name the other end (``worker 1234``, ``coordinator``).
    """

    def __init__(self, stream: ByteStream, *, peer: str) -> None:
        self.peer = peer
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()
        self._next_id = 0
        self._waiting: dict[int, _Pending] = {}
        self.closed = anyio.Event()

    async def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > FRAME_MAX_BYTES:
            raise InvalidCheckpointStateError(
                f"a {len(data)}-byte message to {self.peer} exceeds the {FRAME_MAX_BYTES}-byte frame"
            )
        async with self._send_lock:
            await self._stream.send(_HEADER.pack(len(data)) + data)

    async def _receive(self) -> dict[str, Any]:
        (length,) = _HEADER.unpack(await self._reader.receive_exactly(_HEADER.size))
        if length > FRAME_MAX_BYTES:
            raise ValueError(f"{self.peer} sent a {length}-byte frame (limit {FRAME_MAX_BYTES})")
        message = json.loads(await self._reader.receive_exactly(length))
        if not isinstance(message, dict):
            raise ValueError(f"{self.peer} sent a frame that is not a JSON object")
        return message

    async def request(self, kind: str, body: Any = None, *, within: float) -> Any:
        """Send one request and wait, at most ``within`` seconds, for its reply body.

        Raises:
            CheckpointCoordinatorUnavailableError: The channel closed or no reply came in time.
            MidflightError: The other end refused, with its own code.
        """
        if self.closed.is_set():
            raise CheckpointCoordinatorUnavailableError(f"the channel to {self.peer} is closed")
        self._next_id += 1
        request_id = self._next_id
        pending = _Pending()
        self._waiting[request_id] = pending
        try:
            await self._send({"id": request_id, "kind": kind, "body": body})
            with anyio.move_on_after(max(within, 0.0)):
                await pending.done.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            raise CheckpointCoordinatorUnavailableError(
                f"the channel to {self.peer} broke while sending {kind}"
            ) from None
        finally:
            self._waiting.pop(request_id, None)
        if not pending.done.is_set():
            raise CheckpointCoordinatorUnavailableError(
                f"{self.peer} did not answer {kind} within {within:g} s"
            )
        if pending.error is not None:
            raise pending.error
        return pending.body

    async def serve(self, handler: Handler) -> None:
        """Read frames until the other end goes away; answer requests, resolve replies.

        Requests are answered concurrently (a retire that waits must not stop a marks message).
        On return every waiting request has failed and ``closed`` is set.
        """
        try:
            async with anyio.create_task_group() as group:
                while True:
                    try:
                        message = await self._receive()
                    except (
                        anyio.EndOfStream,
                        anyio.IncompleteRead,
                        anyio.BrokenResourceError,
                        anyio.ClosedResourceError,
                        OSError,
                        ValueError,
                    ):
                        group.cancel_scope.cancel()
                        break
                    if "reply_to" in message:
                        self._resolve(message)
                    else:
                        group.start_soon(self._answer, handler, message)
        finally:
            self.closed.set()
            for pending in self._waiting.values():
                pending.error = CheckpointCoordinatorUnavailableError(f"{self.peer} went away")
                pending.done.set()
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _resolve(self, message: dict[str, Any]) -> None:
        pending = self._waiting.get(message.get("reply_to", -1))
        if pending is None:
            return  # the waiter gave up already
        if message.get("ok"):
            pending.body = message.get("body")
        else:
            error = message.get("error") or {}
            pending.error = error_from_envelope(
                int(error.get("status", 500)),
                {"error": {"code": error.get("code"), "detail": error.get("detail", "")}},
            )
        pending.done.set()

    async def _answer(self, handler: Handler, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        try:
            body = await handler(str(message.get("kind")), message.get("body"))
            reply: dict[str, Any] = {"reply_to": request_id, "ok": True, "body": body}
        except MidflightError as exc:
            reply = {"reply_to": request_id, "ok": False, "error": _error_body(exc)}
        except Exception as exc:
            _log.exception("workers.handler_failed", kind=message.get("kind"), peer=self.peer)
            reply = {
                "reply_to": request_id,
                "ok": False,
                "error": {"status": 500, "code": "internal_error", "detail": type(exc).__name__},
            }
        try:
            await self._send(reply)
        except MidflightError as exc:  # the reply itself cannot be framed
            await self._send({"reply_to": request_id, "ok": False, "error": _error_body(exc)})
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the other end is gone; its waiters fail on their side

    async def aclose(self) -> None:
        """Close the connection (the other end sees end of stream)."""
        await self._stream.aclose()


def _error_body(exc: MidflightError) -> dict[str, Any]:
    return {"status": exc.http_status, "code": exc.code, "detail": exc.detail}


def private_socket_path(name: str) -> Path:
    """A fresh socket path in a new 0700 directory, so only this user can reach it."""
    directory = Path(tempfile.mkdtemp(prefix=f"midflight-{name}-"))
    return directory / "coordinator.sock"


async def listen_private(path: Path) -> SocketListener:
    """Listen on ``path`` and make the socket readable and writable by its owner only (0600)."""
    listener = await anyio.create_unix_listener(path)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    return listener


async def connect(path: Path | str, *, peer: str = "coordinator") -> Channel:
    """Connect to the coordinator's socket (bounded by the message timeout)."""
    with anyio.fail_after(MESSAGE_TIMEOUT_SECONDS):
        stream = await anyio.connect_unix(path)
    return Channel(stream, peer=peer)
