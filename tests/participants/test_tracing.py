"""Server-side tracing: spans that cost nothing while off, a context that crosses processes.

The fan-out channel is two real ends on a Unix socket: a traced request carries its
``traceparent``, and the shard's end answers it in a ``gym.checkpoint.shard.<message>`` span
that is a child of the asker's span.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from participants import (
    SERVER_TELEMETRY,
    checkpoint_span,
    continued,
    current_traceparent,
    listen_private,
    tracing_on,
)
from participants._fanout.channel import Channel, Dispatch, connect
from participants._fanout.messages import Close, Readiness
from participants._tracing import untraced
from protocols import CheckpointRequest, InvalidPhaseError, PrepareReport, attribute, shard_span

from ..span_capture import attributes, recorded_spans

pytestmark = pytest.mark.anyio
__all__ = ["recorded_spans"]  # the fixture, used by name

CLOSE = Close(request=CheckpointRequest(checkpoint_id="ck-1", deadline_ts=1e10), generation=1)
READY = Readiness(
    generation=1,
    seq=1,
    report=PrepareReport(ready=True),
    served=False,
    restored_pending=[],
    extra={},
)


def test_tracing_off_yields_a_span_that_records_nothing() -> None:
    assert not tracing_on()
    with checkpoint_span("gym.checkpoint.prepare", id="ck-1") as span:
        assert not span.is_recording()
        assert current_traceparent() is None


async def test_a_span_records_a_refusal_as_its_outcome_and_code(
    recorded_spans: InMemorySpanExporter,
) -> None:
    assert tracing_on()
    with (
        pytest.raises(InvalidPhaseError),
        checkpoint_span("gym.checkpoint.commit", id="ck-1", instance="m"),
    ):
        raise InvalidPhaseError("commit is not allowed in phase idle")
    (span,) = recorded_spans.get_finished_spans()
    assert attributes(span) == {
        attribute("id"): "ck-1",
        attribute("instance"): "m",
        attribute("outcome"): "refused",
        attribute("code"): "invalid_phase",
    }
    assert span.status.is_unset, "a refusal is an answer, not a failure"


def test_only_a_request_that_carries_a_traceparent_gets_a_server_span() -> None:
    assert SERVER_TELEMETRY["exclude"] is untraced
    assert untraced({"headers": [(b"host", b"x")]})
    assert not untraced(
        {"headers": [(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]}
    )


async def test_the_channel_carries_the_trace_and_the_shard_answers_in_a_child_span(
    tmp_path: Path, recorded_spans: InMemorySpanExporter
) -> None:
    seen: list[str | None] = []

    async def answer(message: Close) -> Readiness:
        seen.append(current_traceparent())
        return READY

    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    async with anyio.create_task_group() as group:
        shard = await connect(path, peer="the fan-out")  # a shard's end spans its answers
        fanout = Channel(await listener.accept(), peer="a shard")
        group.start_soon(shard.serve, Dispatch().on(Close, answer))
        group.start_soon(fanout.serve, Dispatch())
        assert await fanout.request(CLOSE, within=10) == READY  # untraced: no context crosses
        with trace.get_tracer("test").start_as_current_span("prepare") as asker:
            assert await fanout.request(CLOSE, within=10) == READY
        group.cancel_scope.cancel()
    await listener.aclose()
    context = asker.get_span_context()
    assert seen[0] is None
    assert seen[1] is not None and f"{context.trace_id:032x}" in seen[1]
    answered = [s for s in recorded_spans.get_finished_spans() if s.name == shard_span("close")]
    assert len(answered) == 1, "one span for the traced request, none for the other"
    assert answered[0].parent is not None and answered[0].parent.span_id == context.span_id
    assert attributes(answered[0]) == {attribute("peer"): "the fan-out"}


async def test_continued_makes_a_remote_context_current(
    recorded_spans: InMemorySpanExporter,
) -> None:
    traceparent = f"00-{'a' * 32}-{'b' * 16}-01"
    with continued(traceparent), checkpoint_span("gym.checkpoint.resume") as span:
        assert f"{span.get_span_context().trace_id:032x}" == "a" * 32
    with continued(None):
        assert current_traceparent() is None
