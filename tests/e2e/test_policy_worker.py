"""The policy server's cut requests over real sockets: a worker that is not there, or that hangs,
costs a regeneration and never blocks the checkpoint."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from e2e._servers.worker_client import HttpCutRequester, control_root
from participants import ManualClock, MemoryCaptureLedger, ModelParticipant
from protocols import CheckpointRequest, EpisodeId

pytestmark = pytest.mark.anyio
R1 = EpisodeId(rollout_id="r1")


@pytest.mark.parametrize(
    ("base_url", "root"),
    [
        ("http://127.0.0.1:8701", "http://127.0.0.1:8701"),
        ("http://127.0.0.1:8701/", "http://127.0.0.1:8701"),
        ("http://127.0.0.1:8701/v1", "http://127.0.0.1:8701"),
        ("http://127.0.0.1:8701/v1/", "http://127.0.0.1:8701"),
    ],
)
def test_the_control_root_drops_a_trailing_slash_and_v1(base_url: str, root: str) -> None:
    assert control_root(base_url) == root


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def _worker(kind: str) -> AsyncIterator[str]:
    """The base URL of a worker that is unreachable, or that accepts and never answers."""
    if kind == "unreachable":
        yield f"http://127.0.0.1:{_closed_port()}"
        return
    # A listening socket nobody accepts from: the kernel completes the handshake, then silence.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        yield f"http://127.0.0.1:{hung.getsockname()[1]}/v1"


@pytest.mark.parametrize("kind", ["unreachable", "hung"])
async def test_an_unreachable_or_hung_worker_regenerates_and_never_blocks(kind: str) -> None:
    clock = ManualClock()  # frozen: only the cut's own bound (half of 0.4 s) can end a hang
    requester = HttpCutRequester("token")
    model = ModelParticipant(MemoryCaptureLedger(), cut_requester=requester, clock=clock)
    async with _worker(kind) as url, requester.running():
        ticket = await model.admit(R1)
        ticket.backend = url
        ticket.request_digest = "d" * 64
        request = CheckpointRequest(checkpoint_id="c1", deadline_ts=clock.time() + 0.4)
        with anyio.fail_after(30):  # a bound on the test, not an assertion on speed
            await model.close_admission(request)
        report = model.readiness()
        # The later stages still run: nothing blocks, the export carries no cut.
        assert report.ready
        assert (report.counts["cut"], report.counts["cut_failed"]) == (0, 1)
        assert ticket.cut is not None and ticket.cut.disposition == "durable_failure"
        assert await model.export([R1]) == []
