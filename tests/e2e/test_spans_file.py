"""The trace directory's writer: each ended span written at once, by its own thread, read back.

The spans come from a real SDK provider of the test's own (not the process's global one).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from e2e._trace.spans_file import (
    SpansFileExporter,
    SpansFileProcessor,
    read_span_lines,
    spans_file_name,
)


class RecordingExporter(SpansFileExporter):
    """The file exporter, noting which thread wrote each batch."""

    def __init__(self, directory: Path, service: str) -> None:
        super().__init__(directory, service)
        self.threads: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.threads.append(threading.current_thread().name)
        return super().export(spans)


def test_each_ended_span_is_written_by_the_writer_thread_and_read_back(tmp_path: Path) -> None:
    exporter = RecordingExporter(tmp_path, "midflight-model")
    provider = TracerProvider(resource=Resource.create({"service.name": "midflight-model"}))
    provider.add_span_processor(SpansFileProcessor(exporter))
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span("gym.checkpoint.commit") as parent,
        tracer.start_as_current_span("gym.checkpoint.write", attributes={"n": 3}),
    ):
        pass
    assert provider.force_flush(5000)
    lines = read_span_lines(tmp_path)
    assert [line["name"] for line in lines] == ["gym.checkpoint.write", "gym.checkpoint.commit"]
    child, root = lines
    context = parent.get_span_context()
    assert child["parent_span_id"] == root["span_id"] == f"{context.span_id:016x}"
    assert child["attributes"] == {"n": 3}
    assert root["resource"]["service.name"] == "midflight-model"
    assert exporter.threads and set(exporter.threads) == {"midflight-spans"}, "never the caller"
    assert exporter.path.name == spans_file_name("midflight-model", os.getpid())
    provider.shutdown()
    with tracer.start_as_current_span("after shutdown"):
        pass
    assert len(read_span_lines(tmp_path)) == 2


def test_a_torn_or_foreign_line_is_skipped(tmp_path: Path) -> None:
    good = {"name": "a", "trace_id": "1" * 32, "span_id": "2" * 16}
    (tmp_path / "spans-x-1.jsonl").write_text(
        json.dumps(good) + "\n" + '["not a span"]\n' + '{"name": "torn", "trace_id": "1'
    )
    (tmp_path / "other.jsonl").write_text(json.dumps(good) + "\n")
    assert read_span_lines(tmp_path) == [good]
