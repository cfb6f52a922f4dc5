"""One checkpoint is one trace across every server; a restore is a trace linked to it.

The reference servers run in-process (``InProcessCluster``: the real apps, reached through
``httpx.ASGITransport``, real files) with rollouts generating; ``coordinator.checkpoint`` takes a
checkpoint while their calls are on the worker. The spans, from an in-memory exporter, must form
the tree ``protocols._tracing`` draws: the coordinator's stages, one client span per participant,
each participant's operation span (continued from the call's ``traceparent``) and its children,
the policy server's cut round with the worker's span under it. No attribute may carry a secret.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import coordinator._retry
from coordinator import checkpoint, checkpoint_directory, read_latest
from e2e._bench.checkpoint import park
from e2e._bench.common import TOKEN, InProcessCluster, Workload
from protocols import (
    COLLECTION_CHECKPOINT_SPAN,
    COLLECTION_RESTORE_SPAN,
    GENERATION_CUT_SPAN,
    PREPARE_ORDER,
    WORKER_CUT_SPAN,
    attribute,
    call_span,
    coordinate_span,
    operation_span,
    stage_span,
)

from ..span_capture import attributes, children, descendants, recorded_spans, servers_apart

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("servers_apart")]
__all__ = ["recorded_spans", "servers_apart"]  # the fixtures, used by name

PARKED = Workload(activations=2, turns=1, max_tokens=64, token_delay_ms=20.0)
ROLLOUTS = 3
ID = attribute("id")


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}"
    return found[0]


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def check_checkpoint_tree(spans: list[ReadableSpan], checkpoint_id: str) -> ReadableSpan:
    """Assert the whole span tree of one checkpoint; its root."""
    root = one(spans, COLLECTION_CHECKPOINT_SPAN)
    assert root.parent is None and attributes(root)[ID] == checkpoint_id
    assert root.context is not None
    trace_id = root.context.trace_id
    tagged = [s for s in spans if attributes(s).get(ID) == checkpoint_id]
    assert {s.context.trace_id for s in tagged if s.context} == {trace_id}, "one trace"
    below = descendants(spans, root)
    assert {s.name for s in children(spans, root)} >= {
        coordinate_span("prepare"),
        coordinate_span("commit"),
        coordinate_span("publish"),
        coordinate_span("resume"),
    }
    prepare = one(children(spans, root), coordinate_span("prepare"))
    stages = [s.name for s in children(spans, prepare)]
    assert stages == [stage_span(kind) for kind in PREPARE_ORDER], "stages in prepare order"
    served: dict[str, set[str]] = {}
    for call in [s for s in below if s.name.startswith("gym.checkpoint.call.")]:
        operation = call.name.rsplit(".", 1)[1]
        instance = attributes(call)[attribute("instance")]
        # The participant's span, in its own server, continues the call's trace context.
        own = [s for s in descendants(spans, call) if s.name == operation_span(operation)]
        assert len(own) == 1, f"{operation} on {instance}: {len(own)} participant spans"
        assert attributes(own[0])[attribute("instance")] == instance
        assert attributes(own[0])[attribute("outcome")] == "ok"
        served.setdefault(operation, set()).add(instance)
    assert (
        served["prepare"]
        == served["commit"]
        == served["resume"]
        == {
            "environment",
            "policy",
            "agent",
            "resources",
        }
    )
    for commit in named(below, operation_span("commit")):
        parts = {s.name: s for s in children(spans, commit)}
        assert {"gym.checkpoint.export", "gym.checkpoint.write", "gym.checkpoint.manifest"} <= set(
            parts
        )
        written = attributes(parts["gym.checkpoint.write"])
        assert written[attribute("records")] == attributes(commit)[attribute("records")]
        assert written[attribute("bytes")] >= 0
    for prepare_span in named(below, operation_span("prepare")):
        waits = [s.name for s in children(spans, prepare_span)]
        assert "gym.checkpoint.wait_ready" in waits
    cut = one(below, GENERATION_CUT_SPAN)
    cut_attributes = attributes(cut)
    assert cut_attributes[attribute("calls")] >= 1
    assert cut_attributes[attribute("cut")] == cut_attributes[attribute("calls")]
    worker = one(descendants(spans, cut), WORKER_CUT_SPAN)
    assert attributes(worker)[attribute("calls")] == cut_attributes[attribute("calls")]
    return root


def check_no_secret(spans: list[ReadableSpan]) -> None:
    for span in spans:
        for name, value in attributes(span).items():
            assert "token" not in name.lower() and "key" not in name.lower(), name
            assert TOKEN not in str(value), f"the control token in {span.name}.{name}"
            assert "Bearer" not in str(value), f"an authorization header in {span.name}.{name}"
            assert len(str(value)) < 200, f"{span.name}.{name} carries a body, not a figure"


async def take_traced_checkpoint(root: Path) -> None:
    cluster = InProcessCluster(root, PARKED)
    async with cluster.running(), anyio.create_task_group() as group:
        await park(cluster, ROLLOUTS, group, within_s=60.0)
        assert cluster.coordinator is not None
        outcome = await checkpoint(cluster.coordinator, root, "ck-1", deadline_seconds=60.0)
        assert outcome.published
        group.cancel_scope.cancel()  # the crash: this incarnation's rollouts are gone


async def test_one_checkpoint_is_one_trace_across_every_server(
    tmp_path: Path, recorded_spans: InMemorySpanExporter
) -> None:
    await take_traced_checkpoint(tmp_path)
    spans = list(recorded_spans.get_finished_spans())
    root = check_checkpoint_tree(spans, "ck-1")
    check_no_secret(spans)
    stored = json.loads((checkpoint_directory(tmp_path, "ck-1") / "checkpoint.json").read_text())
    assert root.context is not None
    assert stored["traceparent"].startswith(
        f"00-{root.context.trace_id:032x}-{root.context.span_id:016x}-"
    )


async def test_without_propagation_the_tree_falls_apart(
    tmp_path: Path, recorded_spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control calls go out without their traceparent: each participant's span starts a
    # trace of its own, and the check above sees it.
    monkeypatch.setattr(coordinator._retry, "inject_headers", lambda headers: None)
    await take_traced_checkpoint(tmp_path)
    spans = list(recorded_spans.get_finished_spans())
    with pytest.raises(AssertionError, match=r"one trace|participant spans"):
        check_checkpoint_tree(spans, "ck-1")


async def test_a_restore_is_a_trace_of_its_own_linked_to_the_checkpoint(
    tmp_path: Path, recorded_spans: InMemorySpanExporter
) -> None:
    await take_traced_checkpoint(tmp_path)
    latest = read_latest(tmp_path)
    assert latest is not None and latest.traceparent is not None
    checkpoint_trace_id = latest.traceparent.split("-")[1]
    fresh = InProcessCluster(tmp_path, Workload(token_delay_ms=0.0))
    async with fresh.running():
        assert fresh.coordinator is not None
        directory = checkpoint_directory(tmp_path, latest.checkpoint_id)
        deadline = time.time() + 60.0
        await fresh.coordinator.restore("restore-1", deadline, str(directory), latest.continued)
    spans = list(recorded_spans.get_finished_spans())
    restore = one(spans, COLLECTION_RESTORE_SPAN)
    assert restore.parent is None and restore.context is not None
    assert f"{restore.context.trace_id:032x}" != checkpoint_trace_id, "a new trace"
    assert [f"{link.context.trace_id:032x}" for link in restore.links] == [checkpoint_trace_id]
    own = [s for s in descendants(spans, restore) if s.name == operation_span("restore")]
    assert {attributes(s)[attribute("instance")] for s in own} == {
        "environment",
        "policy",
        "agent",
        "resources",
    }
    assert attributes(restore)[attribute("source")] == "ck-1"
    for span in own:
        assert attributes(span)[attribute("source")] == "ck-1", "the checkpoint it read"
        parts = {s.name for s in children(spans, span)}
        assert {"gym.checkpoint.read", "gym.checkpoint.install"} <= parts
    check_no_secret(spans)


async def test_tracing_off_records_nothing_and_stores_no_traceparent(tmp_path: Path) -> None:
    await take_traced_checkpoint(tmp_path)
    stored = json.loads((checkpoint_directory(tmp_path, "ck-1") / "checkpoint.json").read_text())
    assert "traceparent" not in stored
    assert call_span("prepare") == "gym.checkpoint.call.prepare"
