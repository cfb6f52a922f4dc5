"""The coordinator's spans: one trace per checkpoint, one per restore, linked to each other.

Only the OpenTelemetry API is used here: the training controller that embeds the coordinator (or
``midflight``'s own commands) installs an SDK, or nothing is recorded and every function returns
at its first check (D318). A checkpoint and a restore each start a new trace — one checkpoint is
one trace however long the controller's own span runs — with a link to the controller's span when
there is one; a restore also links to the trace of the checkpoint it restores, stored as
``traceparent`` in ``checkpoint.json`` (D320).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, ProxyTracerProvider, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from protocols import (
    COLLECTION_CHECKPOINT_SPAN,
    TRACEPARENT_HEADER,
    WireError,
    attribute,
    is_object_store_url,
    open_store,
)

from ._layout import CHECKPOINT_FILE

TRACER: Final = trace.get_tracer("midflight.coordinator")
"""The tracer of every coordinator span (a no-op until an SDK provider is installed)."""

LINK_KIND: Final = "midflight.link"
"""A link's attribute saying what it points at: ``caller`` or ``restored_checkpoint``."""

_W3C: Final = TraceContextTextMapPropagator()


def _recording() -> bool:
    provider = trace.get_tracer_provider()
    return not isinstance(provider, ProxyTracerProvider | trace.NoOpTracerProvider)


def set_attributes(span: Span, **attributes: Any) -> None:
    """Set ``attributes`` under ``nemo.gym.checkpoint.`` (``None`` values skipped)."""
    if not span.is_recording():
        return
    for name, value in attributes.items():
        if value is not None:
            span.set_attribute(attribute(name), value)


@contextmanager
def coordinator_span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    new_trace: bool = False,
    **attributes: Any,
) -> Iterator[Span]:
    """A coordinator span, current for the block.

    Args:
        name: The span's name (from ``protocols``).
        kind: ``CLIENT`` for a call to one participant.
        new_trace: Start a new trace (a checkpoint's or a restore's root), linked to the span
            that was current, if any.
        attributes: Set under ``nemo.gym.checkpoint.``.
    """
    if not _recording():
        yield trace.INVALID_SPAN
        return
    links: list[Link] = []
    parent = None
    if new_trace:
        caller = trace.get_current_span().get_span_context()
        if caller.is_valid:
            links.append(Link(caller, {LINK_KIND: "caller"}))
        parent = otel_context.Context()  # no parent: a root
    with TRACER.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        set_attributes(span, **attributes)
        try:
            yield span
        except WireError as exc:
            set_attributes(span, outcome="refused", code=exc.code)
            raise
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                set_attributes(span, outcome="error")
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def traceparent_of(span: Span) -> str | None:
    """The W3C ``traceparent`` naming ``span``, or ``None`` for a span not recorded."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@dataclass(frozen=True)
class CheckpointTrace:
    """The root span of one checkpoint's trace (see :func:`checkpoint_trace`).

    Attributes:
        span: The root span (a no-op span while tracing is off).
    """

    span: Span

    @property
    def traceparent(self) -> str | None:
        """What ``checkpoint.json`` stores (``publish_checkpoint(traceparent=...)``), or ``None``."""
        return traceparent_of(self.span)

    def record(self, **attributes: Any) -> None:
        """Set attributes of the checkpoint (``published``, ``rollouts``, ``blockers``, …)."""
        set_attributes(self.span, **attributes)


@contextmanager
def checkpoint_trace(checkpoint_id: str, **attributes: Any) -> Iterator[CheckpointTrace]:
    """One checkpoint as one trace: a new root, current while the block runs.

    :func:`checkpoint` opens it itself; a controller that drives the fixed-order operations one
    by one opens it around them, so its prepare, commit, publication and resume are one trace,
    and passes ``traceparent`` to :func:`publish_checkpoint`.

    Args:
        checkpoint_id: The checkpoint's id (the root's ``nemo.gym.checkpoint.id``).
        attributes: More attributes of the root (``participants=…``).
    """
    with coordinator_span(
        COLLECTION_CHECKPOINT_SPAN, new_trace=True, id=checkpoint_id, **attributes
    ) as span:
        yield CheckpointTrace(span)


def link_to_checkpoint(span: Span, traceparent: str | None) -> None:
    """Link ``span`` to the checkpoint trace ``traceparent`` names (nothing if it names none)."""
    if traceparent is None or not span.is_recording():
        return
    linked = trace.get_current_span(_W3C.extract({TRACEPARENT_HEADER: traceparent}))
    context = linked.get_span_context()
    if context.is_valid:
        span.add_link(context, {LINK_KIND: "restored_checkpoint"})


def stored_traceparent(checkpoint_dir: str | Path) -> str | None:
    """The ``traceparent`` a published ``checkpoint.json`` stores, if it can be read.

    Args:
        checkpoint_dir: The checkpoint: its directory, or its ``s3://`` URL.
    """
    location = checkpoint_dir if is_object_store_url(checkpoint_dir) else Path(checkpoint_dir)
    try:
        stored = json.loads(open_store(location).read(CHECKPOINT_FILE)).get("traceparent")
    except (OSError, ValueError, AttributeError):
        return None
    return stored if isinstance(stored, str) else None


def inject_headers(headers: MutableMapping[str, str]) -> None:
    """Add the current trace context to ``headers`` (nothing when nothing is traced)."""
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)
