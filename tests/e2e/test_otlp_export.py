"""Spans reach an OTLP collector from the standard variables alone.

A real server process (``midflight serve worker``) runs with ``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at a collector on 127.0.0.1 — here a small HTTP server that decodes OTLP/HTTP protobuf
with ``opentelemetry-proto``. A request sent with a ``traceparent`` must arrive there as a server
span of that trace, from ``midflight-worker``; a request without one makes no span. No token is in
anything the collector received.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from .processes import serve

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TOKEN = "otlp-test-token"


@contextmanager
def collector() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """An OTLP/HTTP traces endpoint on 127.0.0.1; the requests it received."""
    received: list[ExportTraceServiceRequest] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.append(request)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_a_traced_request_reaches_the_collector_from_the_otel_variables(tmp_path: Path) -> None:
    with collector() as (endpoint, received):
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms, not the default 5 s
            "MIDFLIGHT_CONTROL_TOKEN": TOKEN,
        }
        with serve("worker", "--root", str(tmp_path), log=tmp_path / "worker.log", env=env) as (
            url,
            _process,
        ):
            httpx.get(f"{url}/healthz", timeout=10).raise_for_status()  # untraced
            traced = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
            httpx.get(f"{url}/healthz", headers=traced, timeout=10).raise_for_status()
            deadline = time.monotonic() + 30
            while not received and time.monotonic() < deadline:
                time.sleep(0.05)
    spans = [
        (resource_spans.resource, span)
        for request in received
        for resource_spans in request.resource_spans
        for scope in resource_spans.scope_spans
        for span in scope.spans
    ]
    assert [span.trace_id.hex() for _resource, span in spans] == [TRACE_ID], "one span, traced"
    resource, span = spans[0]
    assert span.parent_span_id.hex() == "00f067aa0ba902b7"
    assert span.name == "GET /healthz"
    service = {a.key: a.value.string_value for a in resource.attributes}
    assert service["service.name"] == "midflight-worker"
    assert service["midflight.server"] == "worker"
    assert all(TOKEN.encode() not in request.SerializeToString() for request in received)
