"""Turning tracing on in one process: the OpenTelemetry SDK, from the standard variables.

Tracing is off unless asked for, and then costs nothing but a check per span (D318). It is on when

- a trace directory is given (``--trace-dir DIR``, or ``MIDFLIGHT_TRACE_DIR``, which the processes
  a command starts inherit): every finished span is appended to a JSON-lines file there;
- or the standard variables name an OTLP collector: ``OTEL_TRACES_EXPORTER=otlp``, or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` with
  ``OTEL_TRACES_EXPORTER`` unset. Spans then go over OTLP/HTTP (protobuf), batched, and the
  exporter reads every other ``OTEL_EXPORTER_OTLP_*`` variable itself.

``OTEL_SDK_DISABLED=true`` turns both off; ``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` are read as the SDK reads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .spans_file import SpansFileExporter, SpansFileProcessor

TRACE_DIR_ENV: Final = "MIDFLIGHT_TRACE_DIR"
"""The trace directory, inherited by every process a traced command starts."""

SERVER_ATTRIBUTE: Final = "midflight.server"
"""Resource attribute: the server's name (``model``, ``resources-exported``, ``driver``)."""

PROCESS_ATTRIBUTE: Final = "midflight.process"
"""Resource attribute: ``main`` or ``shard`` (a server with several processes)."""


@dataclass(frozen=True)
class TracingChoice:
    """Where this process's spans go.

    Attributes:
        trace_dir: The JSON-lines directory, or ``None``.
        otlp: Whether spans also go to an OTLP collector.
    """

    trace_dir: Path | None
    otlp: bool

    @property
    def enabled(self) -> bool:
        """Whether any span is recorded at all."""
        return self.trace_dir is not None or self.otlp


def tracing_choice(
    trace_dir: Path | None = None, environ: Mapping[str, str] | None = None
) -> TracingChoice:
    """What the option and the environment ask for (nothing is configured)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingChoice(None, False)
    directory = trace_dir
    if directory is None and env.get(TRACE_DIR_ENV):
        directory = Path(env[TRACE_DIR_ENV])
    exporters = {
        name.strip().lower()
        for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip()
    }
    endpoint = bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    otlp = "otlp" in exporters or (not exporters and endpoint)
    return TracingChoice(directory, otlp)


_configured: TracerProvider | None = None


def configure_tracing(
    service: str,
    *,
    server: str,
    process: str = "main",
    trace_dir: Path | None = None,
) -> TracerProvider | None:
    """Install the SDK's tracer provider for this process when tracing is asked for.

    Args:
        service: The ``service.name`` (``midflight-<role>``) unless ``OTEL_SERVICE_NAME`` is set.
        server: The server's name, on every span as ``midflight.server``.
        process: ``main`` or ``shard``.
        trace_dir: The ``--trace-dir`` option (``MIDFLIGHT_TRACE_DIR`` when omitted); it is
            exported to the environment, so the processes this one starts trace there too.

    Returns:
        The provider, or ``None`` when tracing stays off. A second call returns the first
        provider (OpenTelemetry has one per process).
    """
    global _configured
    if _configured is not None:
        return _configured
    choice = tracing_choice(trace_dir)
    if not choice.enabled:
        return None
    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME") or service,
            "service.instance.id": f"{server}/{os.getpid()}",
            "process.pid": os.getpid(),
            SERVER_ATTRIBUTE: server,
            PROCESS_ATTRIBUTE: process,
        }
    )
    provider = TracerProvider(resource=resource)
    if choice.trace_dir is not None:
        directory = choice.trace_dir.resolve()
        os.environ[TRACE_DIR_ENV] = str(directory)
        # Written by a thread as each span ends: a SIGKILL keeps every span that finished (D319).
        provider.add_span_processor(SpansFileProcessor(SpansFileExporter(directory, service)))
    if choice.otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = provider
    return provider
