"""Spans of the server side, and the trace context carried across calls and processes.

Everything here goes through the OpenTelemetry API only: the process that serves decides whether
spans are recorded (see ``midflight serve --trace-dir`` and the ``OTEL_*`` variables). While no
SDK is installed every function returns at its first check, so tracing off costs a function call
per span and nothing on the wire (D318).

- :func:`checkpoint_span` opens one span named from ``protocols`` with attributes under
  ``nemo.gym.checkpoint.``; a coded refusal is recorded as the span's ``outcome`` and ``code``.
- :data:`SERVER_TELEMETRY` configures FastAPI's own telemetry: a request that arrives with a
  ``traceparent`` gets a server span continuing it (a control route's operation span is its
  child); a request without one passes untouched.
- :func:`inject_headers` sends the current context on with an outgoing call.
- :func:`current_traceparent` / :func:`continued` carry it over the fan-out channel.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Final

from fastapi.telemetry import TelemetryConfig
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import ProxyTracerProvider, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation import get_current_span

from protocols import TRACEPARENT_HEADER, WireError, attribute

TRACER: Final = trace.get_tracer("midflight.participants")
"""The tracer of every server-side span (a no-op until an SDK provider is installed)."""

_NO_SPAN: Final = trace.INVALID_SPAN


def tracing_on() -> bool:
    """Whether this process records spans (an SDK tracer provider is installed)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, ProxyTracerProvider | trace.NoOpTracerProvider)


def set_checkpoint_attributes(span: Span, **attributes: Any) -> None:
    """Set ``attributes`` on ``span`` under ``nemo.gym.checkpoint.`` (``None`` values skipped)."""
    if not span.is_recording():
        return
    for name, value in attributes.items():
        if value is not None:
            span.set_attribute(attribute(name), value)


@contextmanager
def checkpoint_span(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any
) -> Iterator[Span]:
    """A span of checkpoint work, current for the block, ended when it leaves.

    A :class:`~protocols.WireError` leaving the block is recorded as ``outcome=refused`` and
    its ``code`` (the span's status stays unset: a refusal is an answer, not a failure); any
    other exception as ``outcome=error`` with an error status.
    """
    if not tracing_on():
        yield _NO_SPAN
        return
    with TRACER.start_as_current_span(
        name, kind=kind, record_exception=False, set_status_on_exception=False
    ) as span:
        set_checkpoint_attributes(span, **attributes)
        try:
            yield span
        except WireError as exc:
            set_checkpoint_attributes(span, outcome="refused", code=exc.code)
            raise
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                set_checkpoint_attributes(span, outcome="error", code="internal_error")
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


def current_traceparent() -> str | None:
    """The current span's ``traceparent``, or ``None`` when nothing is traced."""
    carrier: dict[str, str] = {}
    inject_headers(carrier)
    return carrier.get(TRACEPARENT_HEADER)


@contextmanager
def continued(traceparent: str | None) -> Iterator[None]:
    """Make ``traceparent`` (from another process) the current context for the block."""
    if traceparent is None or not tracing_on():
        yield
        return
    token = otel_context.attach(propagate.extract({TRACEPARENT_HEADER: traceparent}))
    try:
        yield
    finally:
        otel_context.detach(token)


def inject_headers(headers: MutableMapping[str, str]) -> None:
    """Add the current trace context to ``headers`` (nothing when nothing is traced)."""
    if get_current_span().get_span_context().is_valid:
        propagate.inject(headers)


def untraced(scope: MutableMapping[str, Any]) -> bool:
    """Whether a request carries no ``traceparent`` (FastAPI's telemetry then skips it).

    Probes, polls and the data plane of untraced work stay out of every trace: only a request
    sent from inside a trace gets a server span (D321).
    """
    return not any(key == b"traceparent" for key, _ in scope.get("headers", ()))


SERVER_TELEMETRY: Final[TelemetryConfig] = {
    "operation_spans": False,  # one server span a request: the operation's span is ours
    "metrics": False,  # the servers' metrics are Prometheus, on /metrics
    "logs": False,  # and their logs structlog's
    "exclude": untraced,
}
"""``FastAPI(telemetry=...)`` of every midflight server: FastAPI's own OpenTelemetry server
spans continue an incoming ``traceparent``; a control route's operation span is their child."""
