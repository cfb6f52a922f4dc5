"""A data-path connection that could not be made is tried again, and a peer call that never got
going is named as such, not as a peer that did not answer (D380), and a failed call says how far
it got: connecting, sending, waiting, reading, and on which connection (D382), after how many
failed connection attempts (D405). Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress

import httpx
import pytest

from e2e._servers.agent import HttpAgentPeers
from e2e._servers.environment import HttpEnvironmentPeers, PeerTimeouts
from e2e._servers.peer_pool import peer_transport
from protocols import DeadlineExceededError, InternalError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _free_port() -> int:
    with socket.socket() as probe:  # nothing listens on it once this closes
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
    await writer.drain()
    writer.close()


async def test_a_data_path_connection_that_was_refused_is_tried_again() -> None:
    port = _free_port()
    async with httpx.AsyncClient(transport=peer_transport()) as client:
        call = asyncio.ensure_future(client.get(f"http://127.0.0.1:{port}/x"))
        await asyncio.sleep(0.3)  # refused meanwhile: the first tries found no listener
        assert not call.done()
        server = await asyncio.start_server(_answer, "127.0.0.1", port)
        try:
            reply = await asyncio.wait_for(call, 20)
        finally:
            server.close()
            await server.wait_closed()
    assert reply.status_code == 200
    # Without retries the same call fails at once.
    async with httpx.AsyncClient() as bare:
        with pytest.raises(httpx.ConnectError):
            await bare.get(f"http://127.0.0.1:{_free_port()}/x")


class _FullBacklog:
    """A port whose accept queue is full: a new connection's SYN gets no answer until
    ``drain`` makes room (and then nothing ever accepts or answers)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = int(self.listener.getsockname()[1])
        self.fillers: list[socket.socket] = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with suppress(BlockingIOError):  # in progress: it waits in the queue
                filler.connect(("127.0.0.1", self.port))
            self.fillers.append(filler)
        time.sleep(0.2)

    def drain(self) -> None:
        """Take every queued connection off the queue and stop the fillers' tries."""
        for filler in self.fillers:
            filler.close()
        self.listener.setblocking(False)
        with suppress(BlockingIOError):
            while True:
                self.listener.accept()[0].close()

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.listener.close()


@contextmanager
def _full_backlog() -> Iterator[_FullBacklog]:
    backlog = _FullBacklog()
    try:
        yield backlog
    finally:
        backlog.close()


@asynccontextmanager
async def _peers_of(
    backlog: _FullBacklog, *, retries: int, activation_s: float
) -> AsyncIterator[HttpEnvironmentPeers]:
    """An environment's peers whose agent listens behind ``backlog``, its connects retried."""
    url = f"http://127.0.0.1:{backlog.port}"
    async with (
        httpx.AsyncClient(
            base_url=url, transport=httpx.AsyncHTTPTransport(retries=retries)
        ) as agent,
        httpx.AsyncClient(base_url=url) as resources,
    ):
        yield HttpEnvironmentPeers(agent, resources, PeerTimeouts(activation_s=activation_s))


async def test_a_peer_call_that_never_connected_says_so() -> None:
    """At 2,000 rollouts in flight an activation failed in 46 s with "did not answer within
    900 s" and nothing else: its connection had never been made (D380). A connect is now given
    its call's whole budget (D409), so the call's own deadline ends it, and says it never
    connected."""
    with _full_backlog() as backlog:
        async with _peers_of(backlog, retries=1, activation_s=0.5) as peers:
            with pytest.raises(DeadlineExceededError) as refused:
                await peers.activate("r1", 1)
    message = str(refused.value)
    assert "did not answer within 0.5 s (serve environment --activation-timeout-s)" in message
    assert message.endswith("; no connection was made (1 try)"), message  # D382


async def test_a_connect_is_not_given_up_while_the_event_loop_is_held() -> None:
    """D409: run 23 of the 4,000 drill lost 722 rollouts of its baseline to agent seeds with "no
    connection was made (3 tries)", and the kernel had sent no SYN twice. The environment's
    event loop stalled for up to 10 s, past the 10 s connect timeout, so the client gave up
    connections the kernel had made and the agent had accepted, and tried again. Here the loop
    is held for 10.5 s while a seed connects: the seed goes through, on its first connection."""
    accepted = 0

    async def count_and_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await _answer(reader, writer)

    server = await asyncio.start_server(count_and_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with (
            httpx.AsyncClient(base_url=url, transport=peer_transport()) as agent,
            httpx.AsyncClient(base_url=url, transport=peer_transport()) as resources,
        ):
            peers = HttpEnvironmentPeers(agent, resources, PeerTimeouts(call_s=20.0))
            call = asyncio.ensure_future(peers.seed_agent("r1", "s1", {}))
            for _ in range(5):  # the call's task runs until it waits on its connect
                await asyncio.sleep(0)
            time.sleep(10.5)  # noqa: ASYNC251 - the stall itself, as a loaded loop holds it
            await call
    finally:
        server.close()
        await server.wait_closed()
    assert accepted == 1


async def test_a_peer_call_whose_connection_broke_is_named_in_the_failure() -> None:
    """At 2,000 rollouts in flight one episode failed with only ``ReadError('')``: which of its
    calls broke was not said. A server that reads the request and hangs up gives the same."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with (
            httpx.AsyncClient(base_url=url) as agent,
            httpx.AsyncClient(base_url=url) as resources,
        ):
            peers = HttpEnvironmentPeers(agent, resources)
            with pytest.raises(InternalError) as broke:
                await peers.activate("r1", 1)
    finally:
        server.close()
        await server.wait_closed()
    assert str(broke.value).startswith("agent activation 1 of r1 failed: "), str(broke.value)
    assert broke.value.code == "internal_error"  # the code the episode reported before


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


@asynccontextmanager
async def _serving(handler: Handler) -> AsyncIterator[str]:
    """A server on 127.0.0.1 whose handlers are let go, and closed, before the loop ends."""
    release = asyncio.Event()
    handlers: list[asyncio.Task[None]] = []

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handler(reader, writer, release)
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(run, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        release.set()
        await asyncio.gather(*handlers, return_exceptions=True)
        server.close()
        await server.wait_closed()


async def _seed_failure(url: str, **timeouts: float) -> str:
    async with (
        httpx.AsyncClient(base_url=url, transport=peer_transport()) as agent,
        httpx.AsyncClient(base_url=url, transport=peer_transport()) as resources,
    ):
        peers = HttpEnvironmentPeers(agent, resources, PeerTimeouts(**timeouts))
        with pytest.raises((DeadlineExceededError, InternalError)) as failed:
            await peers.seed_agent("r1", "s1", {"turns": 1})
    return str(failed.value)


async def test_a_peer_that_took_the_whole_request_and_never_answered_is_told_apart() -> None:
    """D382: at 2,000 in flight at once, five seeds "did not answer within 60 s" while the other
    1,995 rollouts finished; nothing said whether the request had even reached the agent."""
    taken: list[bytes] = []

    async def keep_silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, release: asyncio.Event
    ) -> None:
        taken.append(await reader.readuntil(b"\r\n\r\n"))
        await release.wait()

    async with _serving(keep_silent) as url:
        message = await _seed_failure(url, call_s=0.5)
    assert taken, "the request reached the server"
    assert "did not answer within 0.5 s" in message, message
    assert "; the whole request was sent; no answer had come (sent on a new connection" in message


async def test_an_answer_that_stopped_halfway_is_told_apart() -> None:
    async def stop_halfway(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, release: asyncio.Event
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\n{")
        await writer.drain()
        await release.wait()

    async with _serving(stop_halfway) as url:
        message = await _seed_failure(url, call_s=0.5)
    assert "; the answer had begun; it was being read (sent on" in message, message


async def test_a_connection_broken_after_the_request_says_the_request_was_sent() -> None:
    async def hang_up(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, release: asyncio.Event
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with _serving(hang_up) as url:
        message = await _seed_failure(url)
    assert message.startswith("agent sessions/seed of r1 failed: "), message
    assert "; the whole request was sent; no answer had come" in message, message


async def test_a_request_that_went_out_on_a_pooled_connection_says_so() -> None:
    """What the drill at 2,000 in flight needs told apart: a request written down a connection
    an earlier call left idle, and when it went out."""
    calls = 0

    async def answer_once(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, release: asyncio.Event
    ) -> None:
        nonlocal calls
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.lower().split(b"\r\n")
            if b"content-length" in line
        )
        await reader.readexactly(length)  # the seed's JSON body
        calls += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the second call, on the same connection
        calls += 1
        await release.wait()

    async with (
        _serving(answer_once) as url,
        httpx.AsyncClient(base_url=url, transport=peer_transport()) as agent,
    ):
        peers = HttpEnvironmentPeers(agent, agent, PeerTimeouts(call_s=0.5))
        await peers.seed_agent("r1", "s1", {"turns": 1})
        with pytest.raises(DeadlineExceededError) as silent:
            await peers.seed_agent("r1", "s1", {"turns": 1})
    assert calls == 2
    assert "(sent on a pooled connection 0.0 s after the call began)" in str(silent.value)


async def test_the_agents_broken_model_and_tool_calls_say_how_far_they_got() -> None:
    """The agent reported both as "the … server is unreachable", though its request had gone
    out: the model may then have run the call (D382)."""

    async def hang_up(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, release: asyncio.Event
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with _serving(hang_up) as url:
        peers = HttpAgentPeers()
        async with (
            httpx.AsyncClient(base_url=url, transport=peer_transport()) as peers.model,
            httpx.AsyncClient(base_url=url, transport=peer_transport()) as peers.resources,
        ):
            with pytest.raises(InternalError) as model:
                await peers.complete("r1", [{"role": "user", "content": "hi"}], 8)
            with pytest.raises(InternalError) as tool:
                await peers.call_tool("r1", "s1", "add", 1)
    assert str(model.value).startswith("the policy server call of r1 failed: "), model.value
    assert str(tool.value).startswith("the resources tool call add of r1 failed: "), tool.value
    for failure in (model.value, tool.value):
        assert "; the whole request was sent; no answer had come (sent on" in str(failure)


async def test_a_request_sent_after_failed_connects_says_how_many_failed() -> None:
    """Run 20 of the 4,000 drill: nine agent seeds "did not answer within 60 s", each sent on a
    new connection 45.6 s after its call began, and nothing said whether those 45.6 s went into
    connection attempts that failed and were tried again (D405). Refused ones are the attempts
    that fail now (D409)."""
    port = _free_port()
    done = asyncio.Event()
    handlers: list[asyncio.Task[None]] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await reader.readuntil(b"\r\n\r\n")
            await done.wait()
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    url = f"http://127.0.0.1:{port}"
    async with (
        httpx.AsyncClient(base_url=url, transport=peer_transport()) as agent,
        httpx.AsyncClient(base_url=url) as resources,
    ):
        peers = HttpEnvironmentPeers(agent, resources, PeerTimeouts(activation_s=3.0))
        call = asyncio.ensure_future(peers.activate("r1", 1))
        await asyncio.sleep(0.3)  # refused meanwhile: nothing listens yet
        server = await asyncio.start_server(never_answer, "127.0.0.1", port)
        try:
            with pytest.raises(DeadlineExceededError) as silent:
                await call
        finally:
            done.set()
            server.close()
            await asyncio.gather(*handlers, return_exceptions=True)
            await server.wait_closed()
    message = str(silent.value)
    assert "; the whole request was sent; no answer had come (sent on a new connection" in message
    assert "failed connection attempt" in message, message
    failed = int(message.split(", after ")[1].split(" failed")[0])
    assert failed >= 1, message
