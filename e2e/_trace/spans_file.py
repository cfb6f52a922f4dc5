"""Spans as JSON lines in a trace directory: one file per process, one line per finished span.

The line format (what ``midflight trace`` reads)::

    {"name": "gym.checkpoint.prepare", "trace_id": "<32 hex>", "span_id": "<16 hex>",
     "parent_span_id": "<16 hex>" | null, "kind": "SERVER" | "CLIENT" | "INTERNAL" | ...,
     "start_ns": int, "end_ns": int, "status": "UNSET" | "OK" | "ERROR",
     "attributes": {...}, "events": [{"name", "time_ns", "attributes"}],
     "links": [{"trace_id", "span_id", "attributes"}],
     "resource": {"service.name": ..., "service.instance.id": ..., "process.pid": int, ...}}

A span is handed, as it ends, to a writer thread that encodes it and appends it at once with one
``os.write`` on a descriptor opened ``O_APPEND`` (:class:`SpansFileProcessor`, D319): no
file work on the event loop, and what a process ended before a SIGKILL is in the file (bar the
microseconds between a span's end and its write); a power loss may lose the tail, and a reader
skips a torn last line. Each process writes its own file (``spans-<service>-<pid>.jsonl``), so
lines of two processes never interleave.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

SPANS_FILE_GLOB: Final = "spans-*.jsonl"
"""The files of a trace directory that hold spans."""

_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]+")


def spans_file_name(service: str, pid: int) -> str:
    """``spans-<service>-<pid>.jsonl``, the service name made safe as a file name."""
    return f"spans-{_UNSAFE.sub('_', service) or 'midflight'}-{pid}.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    return [_jsonable(item) for item in value]  # OpenTelemetry's sequences of primitives


def span_line(span: ReadableSpan) -> dict[str, Any]:
    """One finished span in the trace directory's line format."""
    context = span.get_span_context()
    parent = span.parent
    assert context is not None
    return {
        "name": span.name,
        "trace_id": format_trace_id(context.trace_id),
        "span_id": format_span_id(context.span_id),
        "parent_span_id": None if parent is None else format_span_id(parent.span_id),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "events": [
            {
                "name": event.name,
                "time_ns": event.timestamp,
                "attributes": {k: _jsonable(v) for k, v in (event.attributes or {}).items()},
            }
            for event in span.events
        ],
        "links": [
            {
                "trace_id": format_trace_id(link.context.trace_id),
                "span_id": format_span_id(link.context.span_id),
                "attributes": {k: _jsonable(v) for k, v in (link.attributes or {}).items()},
            }
            for link in span.links
        ],
        "resource": {k: _jsonable(v) for k, v in span.resource.attributes.items()},
    }


class SpansFileExporter(SpanExporter):
    """Appends each exported span to ``<directory>/spans-<service>-<pid>.jsonl``.

    Args:
        directory: The trace directory (created if missing).
        service: The process's service name (part of the file name).
    """

    def __init__(self, directory: Path, service: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / spans_file_name(service, os.getpid())
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write ``spans``, one line each, in one write."""
        data = "".join(
            json.dumps(span_line(span), separators=(",", ":")) + "\n" for span in spans
        ).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the file."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered: every export was written at once."""
        return True


_BATCH: Final = 512
"""Most spans one write carries (what queued up while the thread was writing)."""


class SpansFileProcessor(SpanProcessor):
    """Hands each ended span to a thread that writes it at once (not batched, not on the loop).

    Args:
        exporter: Where the spans go.
    """

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self._queue: queue.SimpleQueue[ReadableSpan | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="midflight-spans", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing: a span is written when it ends."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue the span for the writer thread (a sampled one; the queue never blocks)."""
        if span.context is not None and span.context.trace_flags.sampled:
            self._queue.put(span)

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            batch: list[ReadableSpan] = []
            flushed: list[threading.Event] = []
            stop = False
            while True:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    flushed.append(item)
                else:
                    batch.append(item)
                if stop or len(batch) >= _BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._exporter.export(batch)
            for event in flushed:
                event.set()
            if stop:
                return

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until every span queued so far is written."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Write what is queued, stop the thread, close the file."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._exporter.shutdown()


def read_span_lines(directory: Path) -> list[dict[str, Any]]:
    """Every span line of every spans file in ``directory`` (torn or foreign lines skipped)."""
    lines: list[dict[str, Any]] = []
    for path in sorted(directory.glob(SPANS_FILE_GLOB)):
        for raw in path.read_bytes().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # the last line of a process killed while writing it
            if isinstance(line, dict) and "trace_id" in line and "span_id" in line:
                lines.append(line)
    return lines
