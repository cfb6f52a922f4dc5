"""The coordinator's trace: a new root per checkpoint, linked to the controller's own span.

A checkpoint taken while the controller has a span open is a trace of its own (one checkpoint,
one trace) with a link back to that span; its ``traceparent`` is what ``checkpoint.json`` stores,
and a restore links to it. Attribute names that collectors redact are refused outright.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator import checkpoint_trace
from coordinator._tracing import LINK_KIND, link_to_checkpoint, stored_traceparent
from protocols import COLLECTION_CHECKPOINT_SPAN, attribute, open_store

from ..span_capture import attributes, recorded_spans

__all__ = ["recorded_spans"]  # the fixture, used by name


def test_a_checkpoint_is_a_new_trace_linked_to_the_controllers_span(
    recorded_spans: InMemorySpanExporter,
) -> None:
    with (
        trace.get_tracer("controller").start_as_current_span("training step") as step,
        checkpoint_trace("ck-7", participants=4) as traced,
    ):
        traced.record(published=True, rollouts=12)
        stored = traced.traceparent
    (root,) = [
        s for s in recorded_spans.get_finished_spans() if s.name == COLLECTION_CHECKPOINT_SPAN
    ]
    assert root.parent is None, "one checkpoint is one trace, not a child of the step"
    assert root.context is not None
    assert root.context.trace_id != step.get_span_context().trace_id
    (link,) = root.links
    assert link.context.span_id == step.get_span_context().span_id
    assert dict(link.attributes or {}) == {LINK_KIND: "caller"}
    assert attributes(root) == {
        attribute("id"): "ck-7",
        attribute("participants"): 4,
        attribute("published"): True,
        attribute("rollouts"): 12,
    }
    assert stored is not None
    version, trace_id, span_id, _flags = stored.split("-")
    assert (version, trace_id, span_id) == (
        "00",
        f"{root.context.trace_id:032x}",
        f"{root.context.span_id:016x}",
    )


def test_off_there_is_no_traceparent_to_store() -> None:
    with checkpoint_trace("ck-7") as traced:
        assert traced.traceparent is None
        traced.record(published=True)  # nothing to record on, and no error


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_restore_links_to_the_trace_a_manifest_stores(
    recorded_spans: InMemorySpanExporter, tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    checkpoint: str | Path = tmp_path
    if where == "s3":
        checkpoint = f"{request.getfixturevalue('s3_root')}/checkpoints/ck-7"
    body = '{"traceparent": "00-' + "c" * 32 + "-" + "d" * 16 + '-01"}'
    open_store(checkpoint).replace("checkpoint.json", body.encode())
    stored = stored_traceparent(checkpoint)
    with trace.get_tracer("t").start_as_current_span("restore") as span:
        link_to_checkpoint(span, stored)
    (finished,) = recorded_spans.get_finished_spans()
    assert [f"{link.context.trace_id:032x}" for link in finished.links] == ["c" * 32]


@pytest.mark.parametrize(
    "content", [None, "", "not json", "[]", '{"traceparent": 3}', '{"other": 1}']
)
def test_a_missing_or_unreadable_traceparent_is_none(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "checkpoint.json").write_text(content)
    assert stored_traceparent(tmp_path) is None
    assert stored_traceparent("s3://Not_A_Bucket/checkpoints/c1") is None


@pytest.mark.parametrize("name", ["api_key", "token_ids", "bearerToken", "Key"])
def test_an_attribute_that_names_a_key_or_a_token_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="key or token"):
        attribute(name)
