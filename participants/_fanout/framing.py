"""Frames over one fan-out channel's socket: whole frames, many per system call, in both directions.

A frame is a 4-byte big-endian length and that many bytes. Both ends used to move one frame per
turn of the event loop, or two: a reader asked the socket for the 4 bytes of a header and then for
exactly the frame's length, and each read yields to the event loop; a writer wrote each frame
under an ``anyio.Lock``, and a stream's ``send`` yields before it writes, so senders that came
together queued on the lock, which passes to its next waiter only when the event loop next runs
that waiter. At thousands of rollouts a turn of the loop runs thousands of other tasks, and a burst
of claims waited tens of seconds to cross although the socket had room (D399).

:class:`FrameReader` reads whatever the socket holds, up to a large chunk, and hands out every
whole frame in it before it reads again. :class:`FrameWriter` has no lock: a sender appends its
frame and returns; one writer joins everything appended so far into a single ``send``, and again
until nothing is left. While the channel is served the writer is a task of the channel's
``serve`` (:meth:`FrameWriter.run`); before that (a shard's ``register`` goes out as its channel
starts) the sender writes itself. A write is never cancelled halfway, so the other end never reads
half a frame. Senders wait only while more than :data:`HIGH_WATER_BYTES` are queued. A write that
fails fails every later send and closes the stream, so the reading side ends and every request
waiting for a reply fails at once.
"""

from __future__ import annotations

import contextlib
from typing import Final

import anyio
from anyio.abc import ByteStream

HEADER_BYTES: Final = 4
"""The length prefix of every frame (big-endian)."""
RECEIVE_CHUNK_BYTES: Final = 256 * 1024
"""The most a read asks the socket for, unless a frame needs more."""

HIGH_WATER_BYTES: Final = 8 * 1024 * 1024
"""Queued bytes past which a sender waits for the writer to take them (backpressure)."""


class FrameWriter:
    """The frames waiting to be written to ``stream``, and the one writer that writes them.

    Args:
        stream: The connected stream (the channel's socket).
        high_water: Queued bytes past which :meth:`put` waits for the writer.
    """

    def __init__(self, stream: ByteStream, *, high_water: int = HIGH_WATER_BYTES) -> None:
        self._stream = stream
        self._high_water = high_water
        self._queued: list[bytes] = []
        self._queued_bytes = 0
        self._writing = False
        self._writer_running = False
        self._wake = anyio.Event()
        self._taken = anyio.Event()
        self._failed: BaseException | None = None

    async def put(self, payload: bytes) -> None:
        """Queue the frame of ``payload`` behind everything queued before it.

        Raises:
            anyio.BrokenResourceError: A write failed; the connection is gone.
        """
        if self._failed is None:
            data = len(payload).to_bytes(HEADER_BYTES, "big") + payload
            self._queued.append(data)
            self._queued_bytes += len(data)
            if self._writer_running:
                self._wake.set()
                while self._queued_bytes > self._high_water and self._failed is None:
                    await self._taken.wait()
            elif not self._writing:
                await self._drain()  # nobody writes yet: this sender does, everything queued
        if self._failed is not None:
            raise anyio.BrokenResourceError("the connection failed while writing")

    async def run(self) -> None:
        """Write whatever is queued, as it comes, until cancelled or a write fails (a task of
        ``serve``: a failed write closed the stream, so ``serve`` ends too)."""
        self._writer_running = True
        try:
            while self._failed is None:
                if self._queued and not self._writing:
                    await self._drain()
                    continue
                await self._wake.wait()
                self._wake = anyio.Event()
        finally:
            self._writer_running = False

    async def _drain(self) -> None:
        """Write until nothing is queued; on failure, fail every later send and close."""
        self._writing = True
        try:
            # Shielded: half a frame on the wire would leave the other end unable to read on.
            with anyio.CancelScope(shield=True):
                while self._queued:
                    data = self._queued[0] if len(self._queued) == 1 else b"".join(self._queued)
                    self._queued = []
                    self._queued_bytes = 0
                    self._taken.set()
                    self._taken = anyio.Event()
                    await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._fail(exc)
            await self._close_quietly()
        finally:
            self._writing = False

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._queued = []
        self._queued_bytes = 0
        self._taken.set()  # senders waiting for room learn of the failure

    async def _close_quietly(self) -> None:
        with (
            anyio.CancelScope(shield=True),
            contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
        ):
            await self._stream.aclose()


class FrameReader:
    """The frames arriving on ``stream``, each handed out whole.

    Args:
        stream: The connected stream (the channel's socket).
        max_bytes: The longest payload accepted; a longer length means the stream cannot be
            trusted past it.
    """

    def __init__(self, stream: ByteStream, *, max_bytes: int) -> None:
        self._stream = stream
        self._max_bytes = max_bytes
        self._buffer = bytearray()

    async def next(self) -> bytes:
        """The next frame's payload, read from the socket only when none is buffered whole.

        Raises:
            anyio.EndOfStream: The other end closed (``IncompleteRead`` when mid-frame).
            ValueError: A frame's length is over the limit.
        """
        buffer = self._buffer
        while True:
            needed = HEADER_BYTES
            if len(buffer) >= HEADER_BYTES:
                length = int.from_bytes(buffer[:HEADER_BYTES], "big")
                if length > self._max_bytes:
                    raise ValueError(f"a {length}-byte frame (limit {self._max_bytes})")
                needed = HEADER_BYTES + length
                if len(buffer) >= needed:
                    payload = bytes(buffer[HEADER_BYTES:needed])
                    del buffer[:needed]  # a bytearray drops its front without moving the rest
                    return payload
            try:
                chunk = await self._stream.receive(max(RECEIVE_CHUNK_BYTES, needed - len(buffer)))
            except anyio.EndOfStream:
                if buffer:
                    raise anyio.IncompleteRead from None
                raise
            buffer.extend(chunk)
