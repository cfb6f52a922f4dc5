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
FANOUT_SOCKET_ENV: Final = "MIDFLIGHT_FANOUT_SOCKET"
"""The environment variable naming the coordinator's socket path in every worker."""

Handler = Callable[[str, Any], Awaitable[Any]]
"""Answers one request: ``(kind, body) -> reply body``; raises a ``MidflightError`` to refuse."""

_log = structlog.get_logger("midflight.fanout")
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


SOCKET_OWNER_FILE: Final = "owner"
"""In a socket directory: ``<pid> <start time>`` of the process that made it (D243)."""


def _start_time(pid: int) -> str | None:
    """When ``pid`` started, in clock ticks since boot (Linux); ``None`` when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _owner_is_dead(owner: str) -> bool:
    try:
        pid_text, started = owner.split()
        pid = int(pid_text)
    except ValueError:
        return False  # not ours to judge: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, and someone else's
    now = _start_time(pid)
    if now is None:  # a zombie holds nothing; without /proc, os.kill's answer is all we have
        return Path("/proc/self/stat").exists()
    return started != "-" and now != started  # another start time: the pid was reused


def remove_stale_socket_dirs(name: str, *, base: Path | None = None) -> list[Path]:
    """Remove the socket directories of server ``name`` whose owner process is dead.

    A SIGKILLed coordinator never removes its directory; the next start of the same server does.
    Only directories of this user with an owner file naming a dead process are touched.

    Returns:
        The directories removed.
    """
    removed = []
    for directory in Path(base or tempfile.gettempdir()).glob(f"midflight-{name}-*"):
        try:
            if directory.is_symlink() or directory.stat().st_uid != os.getuid():
                continue
            owner = (directory / SOCKET_OWNER_FILE).read_text()
        except OSError:
            continue  # gone meanwhile, not a directory, or made before owner files existed
        if _owner_is_dead(owner):
            for entry in directory.iterdir():
                entry.unlink(missing_ok=True)
            directory.rmdir()
            removed.append(directory)
    if removed:
        _log.info("socket_dirs.removed", server=name, directories=[str(d) for d in removed])
    return removed


def private_socket_path(name: str, *, base: Path | None = None) -> Path:
    """A fresh socket path in a new 0700 directory, so only this user can reach it.

    Directories a dead coordinator of the same name left behind are removed first; the new one
    names this process as its owner.
    """
    remove_stale_socket_dirs(name, base=base)
    directory = Path(tempfile.mkdtemp(prefix=f"midflight-{name}-", dir=base))
    started = _start_time(os.getpid()) or "-"
    (directory / SOCKET_OWNER_FILE).write_text(f"{os.getpid()} {started}\n")
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
