"""Recording spans in a test: one SDK provider for the whole process, installed per test.

OpenTelemetry keeps one tracer provider per process and every ``ProxyTracer`` binds to the
first one it meets, so the tests share one provider (spans go to an in-memory exporter that each
test empties) and install it only while a test runs: outside these tests tracing stays off, as
every other test expects.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider(resource=Resource.create({"service.name": "midflight-tests"}))
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


def _install(provider: TracerProvider | None) -> None:
    # The API allows one set_tracer_provider per process; tests swap it, as its own tests do.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = provider


@pytest.fixture
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test; the exporter holds every span that ended meanwhile."""
    _EXPORTER.clear()
    _install(_PROVIDER)
    try:
        yield _EXPORTER
    finally:
        _install(None)
        _EXPORTER.clear()


@pytest.fixture
def servers_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process servers that share no trace context but what their requests carry.

    ``httpx.ASGITransport`` runs the app in the caller's task, so the caller's current span
    would be the server's too, headers or not. Here each request is served in a task whose trace
    context starts empty, as in another process: only ``traceparent`` joins the two.
    """
    serve = httpx.ASGITransport.handle_async_request

    async def apart(self: httpx.ASGITransport, request: httpx.Request) -> httpx.Response:
        context = contextvars.copy_context()
        context.run(otel_context.attach, otel_context.Context())
        return await asyncio.create_task(serve(self, request), context=context)

    monkeypatch.setattr(httpx.ASGITransport, "handle_async_request", apart)


def attributes(span: ReadableSpan) -> dict[str, Any]:
    """The span's attributes as a plain dict."""
    return dict(span.attributes or {})


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans whose parent is ``parent``, by start time."""
    assert parent.context is not None
    found = [
        s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def descendants(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """Every span below ``parent``."""
    found: list[ReadableSpan] = []
    for child in children(spans, parent):
        found += [child, *descendants(spans, child)]
    return found
