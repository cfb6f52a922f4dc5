"""The private channel between a server's main process and its shard processes.

One Unix-socket connection per shard carries requests and replies in both directions. A frame is
a 4-byte big-endian length followed by compact JSON, at most :data:`FRAME_MAX_BYTES`, and is one
of the models of :mod:`.messages`: a request ``{"frame": "request", "id", "message"}`` (the message
tagged by ``kind``), its reply ``{"frame": "reply", "reply_to", "body"}`` or ``{"frame": "error",
"reply_to", "error": {"status", "code", "detail"}}``, so a typed error crosses the channel with its
status and code.

Everything is checked where it arrives: a request whose message is unknown or malformed is
answered with ``invalid_request`` and the connection goes on; a reply that is not what its request
names is an ``internal_error`` for the waiting caller. Every wait for a reply has a deadline.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import anyio
import structlog
from anyio.abc import ByteStream
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from protocols import (
    CheckpointCoordinatorUnavailableError,
    InternalError,
    InvalidCheckpointStateError,
    InvalidRequestError,
    WireError,
    error_from_envelope,
    shard_span,
)

from .._tracing import checkpoint_span, continued, current_traceparent
from .framing import FrameReader, FrameWriter
from .messages import (
    FRAMES,
    Ask,
    ErrorBody,
    ErrorFrame,
    Message,
    ReplyFrame,
    RequestFrame,
    describe,
    reply_adapter,
)

FRAME_MAX_BYTES: Final = 64 * 1024 * 1024
"""The largest frame either side sends or accepts (a whole share of records fits)."""
MESSAGE_TIMEOUT_SECONDS: Final = 30.0
"""How long a light message (close, open, marks, report …) waits for its reply."""
REPLY_GRACE_SECONDS: Final = 10.0
"""How long past a control call's own deadline its relayed reply is waited for."""
SLOW_ANSWER_SECONDS: Final = 5.0
"""An answer that took longer from its frame's arrival is logged with where the time went."""
FANOUT_SOCKET_ENV: Final = "MIDFLIGHT_FANOUT_SOCKET"
"""The environment variable naming the fan-out's socket path in every shard process."""

ReplyT = TypeVar("ReplyT")
MessageT = TypeVar("MessageT", bound=Ask[Any])
Handler = Callable[[Any], Awaitable[Any]]
"""Answers one message with its reply; raises a ``WireError`` to refuse."""

_log = structlog.get_logger("midflight.fanout")


class Dispatch:
    """What one end of the channel answers: message type → handler.

    Built once per connection with :meth:`on`; a message with no entry is refused
    (``invalid_request``), never guessed at.
    """

    def __init__(self) -> None:
        self._handlers: dict[type[Ask[Any]], Handler] = {}

    def on(self, kind: type[MessageT], handler: Callable[[MessageT], Awaitable[Any]]) -> Dispatch:
        """Answer ``kind`` with ``handler`` (its reply is checked by the asking end)."""
        self._handlers[kind] = handler
        return self

    def kinds(self) -> frozenset[type[Ask[Any]]]:
        """Every message type this end answers."""
        return frozenset(self._handlers)

    def handler(self, kind: type[Ask[Any]]) -> Handler | None:
        """The handler of ``kind``, if this end answers it."""
        return self._handlers.get(kind)


class _Pending:
    def __init__(self, reply: TypeAdapter[Any], kind: str) -> None:
        self.reply = reply
        self.kind = kind
        self.done = anyio.Event()
        self.body: Any = None
        self.error: WireError | None = None


class Channel:
    """One end of a shard connection.

    Args:
        stream: The connected Unix socket stream.
        peer: How log lines and errors name the other end (``shard 1234``, ``the fan-out``).
        span_answers: Whether each traced request this end answers gets a span of its own
            (``gym.checkpoint.shard.<message>``: a shard process's end); either end continues
            the asker's trace.
    """

    def __init__(self, stream: ByteStream, *, peer: str, span_answers: bool = False) -> None:
        self.peer = peer
        self._span_answers = span_answers
        self._stream = stream
        self._reader = FrameReader(stream, max_bytes=FRAME_MAX_BYTES)
        self._writer = FrameWriter(stream)
        self._next_id = 0
        self._waiting: dict[int, _Pending] = {}
        self.closed = anyio.Event()

    async def _send(self, frame: RequestFrame | ReplyFrame | ErrorFrame) -> None:
        data = FRAMES.dump_json(frame)
        if len(data) > FRAME_MAX_BYTES:
            raise InvalidCheckpointStateError(
                f"a {len(data)}-byte message to {self.peer} exceeds the {FRAME_MAX_BYTES}-byte frame"
            )
        await self._writer.put(data)

    async def _receive(self) -> bytes:
        try:
            return await self._reader.next()
        except ValueError as exc:
            # The stream cannot be trusted past a length this wrong: the connection ends.
            raise ValueError(f"{self.peer} sent {exc}") from None

    async def request(self, message: Ask[ReplyT], *, within: float) -> ReplyT:
        """Send one message and wait, at most ``within`` seconds, for its checked reply.

        Raises:
            CheckpointCoordinatorUnavailableError: The channel closed or no reply came in time.
            InternalError: The reply is not what the message names.
            WireError: The other end refused, with its own code.
        """
        kind = message.kind
        if self.closed.is_set():
            raise CheckpointCoordinatorUnavailableError(f"the channel to {self.peer} is closed")
        self._next_id += 1
        request_id = self._next_id
        pending = _Pending(reply_adapter(type(message)), kind)
        self._waiting[request_id] = pending
        try:
            frame = RequestFrame(
                id=request_id, message=cast(Message, message), traceparent=current_traceparent()
            )
            await self._send(frame)
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
        return cast(ReplyT, pending.body)

    async def serve(self, dispatch: Dispatch) -> None:
        """Read frames until the other end goes away; answer requests, resolve replies.

        Requests are answered concurrently (a retire that waits must not stop a marks message).
        On return every waiting request has failed and ``closed`` is set.
        """
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._writer.run)
                while True:
                    try:
                        data = await self._receive()
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
                    try:
                        frame = FRAMES.validate_json(data)
                    except ValidationError as exc:
                        group.start_soon(self._refuse_malformed, data, exc)
                        continue
                    if isinstance(frame, RequestFrame):
                        group.start_soon(self._answer, dispatch, frame, anyio.current_time())
                    else:
                        self._resolve(frame)
        finally:
            self.closed.set()
            for pending in self._waiting.values():
                pending.error = CheckpointCoordinatorUnavailableError(f"{self.peer} went away")
                pending.done.set()
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _resolve(self, frame: ReplyFrame | ErrorFrame) -> None:
        pending = self._waiting.get(frame.reply_to)
        if pending is None:
            return  # the waiter gave up already
        if isinstance(frame, ErrorFrame):
            error = frame.error
            pending.error = error_from_envelope(
                error.status, {"error": {"code": error.code, "detail": error.detail}}
            )
        else:
            try:
                # Strict: the reply is exactly what the message names (``"yes"`` is no bool).
                pending.body = pending.reply.validate_python(frame.body, strict=True)
            except ValidationError as exc:
                pending.error = InternalError(
                    f"{self.peer} answered {pending.kind} with a malformed reply: {describe(exc)}"
                )
        pending.done.set()

    async def _refuse_malformed(self, data: bytes, exc: ValidationError) -> None:
        """A frame the models do not describe: a typed refusal if it can be addressed."""
        try:
            raw = json.loads(data)
        except ValueError:
            raw = None
        detail = f"a malformed message from {self.peer}: {describe(exc)}"[:2000]
        request_id = raw.get("id") if isinstance(raw, dict) else None
        reply_to = raw.get("reply_to") if isinstance(raw, dict) else None
        _log.warning("fanout.malformed_frame", peer=self.peer, detail=detail)
        if isinstance(raw, dict) and raw.get("frame") == "request" and type(request_id) is int:
            await self._send_quietly(
                ErrorFrame(reply_to=request_id, error=_error_body(InvalidRequestError(detail)))
            )
        elif type(reply_to) is int and (pending := self._waiting.get(reply_to)) is not None:
            pending.error = InternalError(detail)
            pending.done.set()

    async def _answer(self, dispatch: Dispatch, frame: RequestFrame, arrived: float) -> None:
        started = anyio.current_time()
        handled: float | None = None
        try:
            reply = await self._reply_to(dispatch, frame)
            handled = anyio.current_time()
            await self._send_reply(frame, reply)
        finally:
            self._log_if_slow(frame.message.kind, arrived, started, handled)

    def _log_if_slow(
        self, kind: str, arrived: float, started: float, handled: float | None
    ) -> None:
        """``fanout.slow_answer`` when the answer took ``SLOW_ANSWER_SECONDS`` or more from the
        frame's arrival, split into: waiting for the event loop to start it, the handler, and
        queueing the reply (which waits only while the writer is behind by more than its high
        water mark; D397, D399)."""
        now = anyio.current_time()
        if now - arrived < SLOW_ANSWER_SECONDS:
            return
        handled = now if handled is None else handled
        _log.warning(
            "fanout.slow_answer",
            kind=kind,
            peer=self.peer,
            seconds=round(now - arrived, 3),
            waited_to_start_s=round(started - arrived, 3),
            handler_s=round(handled - started, 3),
            send_s=round(now - handled, 3),
        )

    async def _reply_to(self, dispatch: Dispatch, frame: RequestFrame) -> ReplyFrame | ErrorFrame:
        """The handler's reply, or the refusal it raised."""
        message = frame.message
        handler = dispatch.handler(type(message))
        reply: ReplyFrame | ErrorFrame
        try:
            if handler is None:
                raise InvalidRequestError(
                    f"{message.kind} is not answered here ({self.peer} sent it)"
                )
            with continued(frame.traceparent), self._answer_span(frame):
                body = await handler(message)
            reply = ReplyFrame(reply_to=frame.id, body=body)
        except WireError as exc:
            reply = ErrorFrame(reply_to=frame.id, error=_error_body(exc))
        except Exception as exc:
            _log.exception("fanout.handler_failed", kind=message.kind, peer=self.peer)
            reply = ErrorFrame(
                reply_to=frame.id,
                error=ErrorBody(status=500, code="internal_error", detail=type(exc).__name__),
            )
        return reply

    async def _send_reply(self, frame: RequestFrame, reply: ReplyFrame | ErrorFrame) -> None:
        message = frame.message
        try:
            await self._send(reply)
        except WireError as exc:  # the reply itself cannot be framed
            await self._send_quietly(ErrorFrame(reply_to=frame.id, error=_error_body(exc)))
        except PydanticSerializationError:  # a handler returned what JSON cannot carry
            _log.exception("fanout.reply_unserializable", kind=message.kind, peer=self.peer)
            refusal = InternalError(f"the reply to {message.kind} cannot be written as JSON")
            await self._send_quietly(ErrorFrame(reply_to=frame.id, error=_error_body(refusal)))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the other end is gone; its waiters fail on their side

    def _answer_span(self, frame: RequestFrame) -> AbstractContextManager[object]:
        if not self._span_answers or frame.traceparent is None:
            return contextlib.nullcontext()
        return checkpoint_span(shard_span(frame.message.kind), peer=self.peer)

    async def _send_quietly(self, frame: ErrorFrame) -> None:
        # The other end may be gone; its waiters fail on their side.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._send(frame)

    async def aclose(self) -> None:
        """Close the connection (the other end sees end of stream)."""
        await self._stream.aclose()


def _error_body(exc: WireError) -> ErrorBody:
    return ErrorBody(status=exc.http_status, code=exc.code, detail=exc.detail)


async def connect(
    path: Path | str, *, peer: str = "the fan-out", span_answers: bool = True
) -> Channel:
    """Connect to the fan-out's socket (bounded by the message timeout); a shard's end."""
    with anyio.fail_after(MESSAGE_TIMEOUT_SECONDS):
        stream = await anyio.connect_unix(path)
    return Channel(stream, peer=peer, span_answers=span_answers)
