"""Real OpenTelemetry spans of several processes in one trace directory, for ``midflight trace``.

Each simulated process has its own ``TracerProvider`` (its own resource) and its own
``SpansFileExporter``. The exporter names its file by the test's pid, so each writes in a scratch
folder of its own and the file is then moved into the trace directory under the name its process
would have given it (``spans-<service>-<pid>.jsonl``): the lines are the exporter's, unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanContext, TraceFlags, format_trace_id

from e2e._trace.spans_file import SpansFileExporter, spans_file_name
from protocols import attribute

T0 = 1_700_000_000_000_000_000  # the checkpoint ck-0003 starts here (ns since the epoch)


def at(ms: float) -> int:
    """``ms`` milliseconds after T0, in nanoseconds."""
    return T0 + round(ms * 1_000_000)


class Process:
    """One traced process: its own provider, resource and spans file."""

    def __init__(
        self, trace_dir: Path, scratch: Path, service: str, server: str, process: str, pid: int
    ) -> None:
        resource = Resource(
            {
                "service.name": service,
                "process.pid": pid,
                "midflight.server": server,
                "midflight.process": process,
            }
        )
        self.exporter = SpansFileExporter(scratch / f"{server}-{pid}", service)
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests.e2e.test_trace_command")
        self.path = trace_dir / spans_file_name(service, pid)

    def span(
        self, name: str, start: float, end: float, parent: Any = None, links: Any = (), **attrs: Any
    ) -> Any:
        """A span from ``start`` to ``end`` ms, its attributes named ``nemo.gym.checkpoint.*``."""
        context = None if parent is None else trace.set_span_in_context(parent)
        span = self.tracer.start_span(
            f"gym.checkpoint.{name}" if not name.startswith("midflight.") else name,
            context=context,
            start_time=at(start),
            links=list(links),
            attributes={attribute(key): value for key, value in attrs.items()},
        )
        span.end(end_time=at(end))
        return span

    def close(self) -> None:
        """Flush and move the file into the trace directory under its process's name."""
        self.provider.shutdown()
        self.exporter.path.rename(self.path)


def trace_id_of(span: Any) -> str:
    return format_trace_id(span.get_span_context().trace_id)


def build_trace_dir(trace_dir: Path, scratch: Path) -> dict[str, str]:
    """Two checkpoints, three restores, a rollout trace, an orphan and a torn line."""
    trace_dir.mkdir()
    p = {
        name: Process(trace_dir, scratch, f"midflight-{service}", server, kind, pid)
        for name, service, server, kind, pid in (
            ("old_driver", "driver", "driver", "main", 4001),
            ("driver", "driver", "driver", "main", 4002),
            ("environment", "environment", "environment", "main", 4101),
            ("agent", "agent", "agent", "main", 4111),
            ("model", "model", "model", "main", 4201),
            ("shard", "model", "model", "shard", 4202),
            ("killed_shard", "model", "model", "shard", 4203),
            ("resources", "resources", "resources-exported", "main", 4301),
            ("worker", "worker", "worker", "main", 4401),
        )
    }
    # ck-0002: the driver was killed mid-prepare, so its root never ended: a stage is an orphan.
    never_ended = p["old_driver"].tracer.start_span(
        "gym.checkpoint.collection.checkpoint", start_time=at(-5000)
    )
    p["old_driver"].span("coordinate.prepare.environment", -4999, -4975, never_ended, id="ck-0002")
    p["environment"].span("prepare", -4995, -4985, never_ended, id="ck-0002", blockers=0)
    p["environment"].span(
        "commit",
        -4970,
        -4950,
        never_ended,
        id="ck-0002",
        outcome="refused",
        code="stale_checkpoint",
    )
    ck2 = trace_id_of(never_ended)

    d, ck = p["driver"], {"id": "ck-0003"}
    root = d.span(
        "collection.checkpoint", 0, 420, participants=4, rollouts=12, published=True, **ck
    )
    prepare = d.span("coordinate.prepare", 5, 250, root, **ck)
    stages = {
        "environment": (5, 100),
        "agent": (100, 130),
        "model": (130, 220),
        "resources": (220, 250),
    }
    blockers = {"agent": 2}
    parts: dict[str, Any] = {}
    for kind, (start, end) in stages.items():
        stage = d.span(f"coordinate.prepare.{kind}", start, end, prepare, **ck)
        call = d.span("call.prepare", start + 1, end - 1, stage, participant_kind=kind, **ck)
        parts[kind] = p[kind].span(
            "prepare",
            start + 2,
            end - 2,
            call,
            blockers=blockers.get(kind, 0),
            prepared=True,
            outcome="ok",
            **ck,
        )
    p["environment"].span("wait_ready", 12, 90, parts["environment"], blockers=0, **ck)
    p["agent"].span("wait_ready", 103, 127, parts["agent"], blockers=2, **ck)
    cut = p["model"].span(
        "generation_cut",
        140,
        200,
        parts["model"],
        calls=6,
        cut=5,
        cut_failed=0,
        cut_skipped=1,
        workers=1,
        **ck,
    )
    p["worker"].span("generation_cut.worker", 145, 190, cut, **ck)
    p["shard"].span("shard.prepare", 150, 185, parts["model"], **ck)

    commit = d.span("coordinate.commit", 250, 350, root, **ck)
    for offset, kind in enumerate(stages):
        call = d.span("call.commit", 251 + offset, 345 - 10 * offset, commit, **ck)
        done = p[kind].span(
            "commit",
            252 + offset,
            340 - 10 * offset,
            call,
            records=3,
            bytes=900,
            episodes=3,
            outcome="ok",
            **ck,
        )
        p[kind].span("export", 253 + offset, 270, done, **ck)
        p[kind].span("write", 270, 300 - 10 * offset, done, records=3, bytes=900, **ck)
        p[kind].span("manifest", 300 - 10 * offset, 305 - 10 * offset, done, **ck)
    p["shard"].span("shard.commit", 262, 330, parts["model"], **ck)
    # The killed shard's parent span (in the main process) never reached the file: an orphan.
    lost = trace.NonRecordingSpan(
        SpanContext(
            root.get_span_context().trace_id, 0xDEAD, is_remote=True, trace_flags=TraceFlags(1)
        )
    )
    p["killed_shard"].span("shard.commit", 265, 320, lost, **ck)
    d.span("coordinate.publish", 350, 360, root, **ck)
    resume = d.span("coordinate.resume", 360, 415, root, **ck)
    for kind, end in zip(stages, (380, 390, 410, 395), strict=True):
        call = d.span("call.resume", 361, end + 1, resume, **ck)
        p[kind].span("resume", 362, end, call, outcome="ok", **ck)
    d.span("midflight.rollout", 20, 300)  # another trace, without a checkpoint id: not listed

    # The restore of ck-0003, linked to its root; one of a checkpoint not in the directory; and
    # one whose root was lost, matched by id.
    link = Link(root.get_span_context())
    # A restore's spans carry its own id; the root and each participant name its source.
    of_ck3 = {"id": "restore-1", "source": "ck-0003"}
    restore = d.span("collection.restore", 1000, 1300, links=[link], **of_ck3)
    for lane, (start, end) in {"environment": (1010, 1100), "model": (1020, 1200)}.items():
        done = p[lane].span("restore", start, end, restore, records=3, outcome="ok", **of_ck3)
        p[lane].span("read", start + 5, start + 40, done, id="restore-1")
        p[lane].span("install", start + 40, end - 5, done, id="restore-1")
    foreign = SpanContext(0xABC, 0x1, is_remote=True)
    elsewhere = d.span(
        "collection.restore", 2000, 2100, links=[Link(foreign)], id="restore-9", source="ck-0001"
    )
    rootless = p["environment"].span("restore", 3000, 3050, id="restore-3", source="ck-0002")
    for process in p.values():
        process.close()
    with p["model"].path.open("a") as model_file:
        # A line no span would write (read past, not a crash), then the torn line of a kill.
        model_file.write('{"trace_id": "1", "span_id": "2", "name": "x", "start_ns": "0"}\n')
        model_file.write('{"name": "gym.checkpoint.commit", "trace_id": "')
    return {
        "ck2": ck2,
        "ck3": trace_id_of(root),
        "restore": trace_id_of(restore),
        "elsewhere": trace_id_of(elsewhere),
        "rootless": trace_id_of(rootless),
    }
