"""Frames over a fan-out channel's socket: many frames per system call each way, none torn (D399).

Real Unix sockets, in-process. ``Counting`` wraps a real socket stream and counts the sends and
receives an end makes, which is what a busy event loop pays a turn for each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import pytest
from anyio.abc import ByteStream

from participants import listen_private
from participants._fanout.channel import Channel, Dispatch
from participants._fanout.framing import FrameReader, FrameWriter
from participants._fanout.messages import Claim

pytestmark = pytest.mark.anyio

BIG = b"x" * (8 * 1024 * 1024)
"""More than a socket's buffers hold: its write waits for the reader."""


class Counting(ByteStream):
    """A real stream, with its sends and receives counted."""

    def __init__(self, inner: ByteStream) -> None:
        self.inner = inner
        self.sends = 0
        self.receives = 0

    async def send(self, item: bytes) -> None:
        self.sends += 1
        await self.inner.send(item)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        self.receives += 1
        return await self.inner.receive(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def socket_pair(tmp_path: Path) -> AsyncIterator[tuple[ByteStream, ByteStream]]:
    listener = await listen_private(tmp_path / "f.sock")
    near = await anyio.connect_unix(tmp_path / "f.sock")
    far = await listener.accept()
    try:
        yield near, far
    finally:
        await near.aclose()
        await far.aclose()
        await listener.aclose()


async def test_frames_that_come_together_cross_in_a_few_system_calls(tmp_path: Path) -> None:
    async def yes(message: Claim) -> bool:
        return True

    async with socket_pair(tmp_path) as (near_stream, far_stream):
        sending, receiving = Counting(near_stream), Counting(far_stream)
        near = Channel(sending, peer="far")
        far = Channel(receiving, peer="near")
        answers: list[bool] = []

        async def claim(index: int) -> None:
            answers.append(await near.request(Claim(capture_key=f"r{index}"), within=10))

        async with anyio.create_task_group() as group:
            group.start_soon(near.serve, Dispatch())
            group.start_soon(far.serve, Dispatch().on(Claim, yes))
            async with anyio.create_task_group() as claims:
                for index in range(200):
                    claims.start_soon(partial(claim, index))
            group.cancel_scope.cancel()
    assert answers == [True] * 200
    # One write and one read per frame (two reads: header, then body) before D399.
    assert sending.sends <= 10
    assert receiving.receives <= 10


async def test_a_reader_hands_out_every_buffered_frame_before_it_reads_again(
    tmp_path: Path,
) -> None:
    payloads = [f"frame {n}".encode() * (n + 1) for n in range(100)]
    async with socket_pair(tmp_path) as (near, far):
        await near.send(b"".join(len(p).to_bytes(4, "big") + p for p in payloads))
        counted = Counting(far)
        reader = FrameReader(counted, max_bytes=1 << 20)
        with anyio.fail_after(10):
            assert [await reader.next() for _ in payloads] == payloads
        assert counted.receives <= 2


async def test_a_reader_refuses_an_oversized_length_and_tells_a_torn_frame_from_an_end(
    tmp_path: Path,
) -> None:
    async with socket_pair(tmp_path) as (near, far):
        await near.send((11).to_bytes(4, "big") + b"x" * 11)
        with pytest.raises(ValueError, match="11-byte frame"):
            await FrameReader(far, max_bytes=10).next()
    async with socket_pair(tmp_path) as (near, far):
        await near.send((5).to_bytes(4, "big") + b"ab")
        await near.send_eof()
        with pytest.raises(anyio.IncompleteRead):
            await FrameReader(far, max_bytes=10).next()
    async with socket_pair(tmp_path) as (near, far):
        await near.send((2).to_bytes(4, "big") + b"ok")
        await near.send_eof()
        reader = FrameReader(far, max_bytes=10)
        assert await reader.next() == b"ok"
        with pytest.raises(anyio.EndOfStream):
            await reader.next()


async def test_a_sender_cancelled_mid_write_never_leaves_half_a_frame(tmp_path: Path) -> None:
    async with socket_pair(tmp_path) as (near, far):
        writer = FrameWriter(near)  # not running: each sender writes itself
        reader = FrameReader(far, max_bytes=len(BIG))
        frames: list[bytes] = []

        async def read_late() -> None:
            await anyio.sleep(0.3)  # the big write is stuck on a full socket until then
            frames.extend([await reader.next(), await reader.next()])

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(read_late)
                with anyio.move_on_after(0.05):
                    await writer.put(BIG)
                await writer.put(b"after")
    assert frames == [BIG, b"after"]


async def test_senders_wait_only_while_the_queue_is_past_its_high_water(tmp_path: Path) -> None:
    async with socket_pair(tmp_path) as (near, far):
        writer = FrameWriter(near, high_water=1000)
        reader = FrameReader(far, max_bytes=len(BIG))
        third_queued = anyio.Event()

        async def third() -> None:
            await writer.put(b"b" * 600)
            third_queued.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(writer.run)
                await anyio.wait_all_tasks_blocked()  # the writer runs: senders only queue
                await writer.put(BIG)  # taken by the writer, whose write then waits
                await anyio.wait_all_tasks_blocked()
                await writer.put(b"a" * 600)  # 604 bytes queued: under the mark
                group.start_soon(third)
                await anyio.wait_all_tasks_blocked()
                waited = not third_queued.is_set()  # 1,208 queued: it waits for the writer
                frames = [await reader.next() for _ in range(3)]
                await third_queued.wait()
                group.cancel_scope.cancel()
    assert waited
    assert frames == [BIG, b"a" * 600, b"b" * 600]


async def test_a_failed_write_fails_every_later_send(tmp_path: Path) -> None:
    async with socket_pair(tmp_path) as (near, far):
        await far.aclose()
        writer = FrameWriter(near)
        failed: BaseException | None = None
        with anyio.fail_after(10):
            for _ in range(100):  # the first writes may land in the buffer before the reset
                try:
                    await writer.put(b"x" * 65536)
                except anyio.BrokenResourceError as exc:
                    failed = exc
                    break
            with pytest.raises(anyio.BrokenResourceError):
                await writer.put(b"late")
    assert failed is not None
