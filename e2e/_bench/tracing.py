"""The tracing benchmark: what a model call and a checkpoint cost with tracing off and on.

The modes alternate round by round (the order flips each round), so both see the same machine:

- **off**: no tracer provider installed (every deployment unless it asks for tracing); every
  span call returns at its first check. This is the floor.
- **checkpoints**: the same provider, rollouts untraced: a controller that traces its checkpoints
  and not its rollouts (a request without a ``traceparent`` gets no span). What a deployment
  with tracing on pays on its data plane.
- **on**: the SDK's provider with the ``SpansFileProcessor`` handing each span, as it ends, to the
  thread that writes it to a JSON-lines file (what ``--trace-dir`` installs), every rollout inside a ``ROLLOUT_SPAN``: each
  data-plane call carries a ``traceparent`` and gets a server span on every hop. The worst case.

Each mode measures, each part on a fresh :class:`~e2e._bench.common.InProcessCluster`: (1) the
data plane, ``rollouts`` counter-task rollouts on an unpaced worker (CPU dominates),
``concurrency`` in flight: wall and process-CPU µs per captured model call, span lines per
rollout; (2) one checkpoint of ``parked`` rollouts generating on a slow worker, inside its
``checkpoint_trace`` (a no-op when off): the pause and the span lines it wrote. A micro-loop
times one ``checkpoint_span`` with no provider against an empty ``nullcontext``: what "off costs
nothing" rests on.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import httpx
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util._once import Once

from coordinator import checkpoint_trace
from participants import tracing_on
from protocols import COLLECTION_CHECKPOINT_SPAN, ROLLOUT_SPAN, EpisodeId

from .._trace.propagation import TRACE_HOOKS
from .._trace.setup import PROCESS_ATTRIBUTE, SERVER_ATTRIBUTE
from .._trace.spans_file import SpansFileExporter, SpansFileProcessor
from .checkpoint import DISPATCH_BATCH, PARKED_WORKLOAD, take_checkpoint
from .common import (
    PARKING,
    InProcessCluster,
    Workload,
    load_average,
    median,
    ratio,
    wait_for,
)
from .span_costs import span_costs

MODES: Final = ("off", "checkpoints", "on")
"""off: no provider; checkpoints: the provider, rollouts untraced; on: everything traced."""
SERVICE: Final = "midflight-bench"
FLOOR: Final = "off: no tracer provider installed; every span call returns at its first check"
DATA_WORKLOAD: Final = Workload(activations=2, turns=1, max_tokens=16, token_delay_ms=0.0)
"""An unpaced worker: the data plane's figures are the servers' CPU, not a generation's pace."""
PARKED_TRACED_WORKLOAD: Final = replace(PARKED_WORKLOAD, token_delay_ms=1000.0)
"""Parked calls generate a token a second: the checkpoint waits at most a second for every call
to grow past its last cut (so every call is cut), and 50 parked calls' tokens cost the loop a
few percent while the checkpoint runs."""
MICRO_LOOPS: Final = 100_000
"""Iterations of the off and ``nullcontext`` micro-loops (the on loop runs a twentieth)."""


class _RunExporter(SpanExporter):
    """Hands spans to this run's file exporter (none between runs): the process keeps one
    provider (see :func:`_bench_tracing`), so a run swaps its spans file in here."""

    def __init__(self) -> None:
        self.target: SpansFileExporter | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        target = self.target
        return target.export(spans) if target is not None else SpanExportResult.SUCCESS


@dataclass(frozen=True)
class _BenchTracing:
    provider: TracerProvider
    exporter: _RunExporter


@functools.cache
def _bench_tracing() -> _BenchTracing:
    """The process's one SDK provider for benchmarks, made on first use.

    OpenTelemetry keeps one tracer provider per process and each ``ProxyTracer`` (the servers'
    module-level tracers) binds to the first provider it sees and keeps it, so a second provider
    would never get their spans: every run of this process shares this one.
    """
    pid = os.getpid()
    resource = Resource.create(
        {
            "service.name": SERVICE,
            "service.instance.id": f"bench/{pid}",
            "process.pid": pid,
            SERVER_ATTRIBUTE: "bench",
            PROCESS_ATTRIBUTE: "main",
        }
    )
    provider = TracerProvider(resource=resource)
    exporter = _RunExporter()
    # As ``--trace-dir`` installs it: each span written by a thread as it ends, one line each.
    provider.add_span_processor(SpansFileProcessor(exporter))
    return _BenchTracing(provider, exporter)


def _install(provider: TracerProvider | None) -> None:
    # The API allows one set_tracer_provider per process and has no way to remove one; the bench
    # turns tracing on and off window by window, so it swaps the global the way OpenTelemetry's
    # own tests (and tests/span_capture.py) do. Tracers bound while on stay bound to the bench's
    # provider, but off has no provider: every span call of the servers checks that first, and
    # the data plane sends no traceparent, so nothing reaches them.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = provider


@contextmanager
def _mode(mode: str, tracing: _BenchTracing) -> Iterator[None]:
    """The mode's provider installed for the block (none for off), uninstalled after."""
    _install(tracing.provider if mode != "off" else None)
    try:
        yield
    finally:
        tracing.provider.force_flush()  # every span of the window in its file before it is read
        _install(None)


def _lines_since(spans: Path, mark: int) -> list[dict[str, Any]]:
    """The lines of the run's spans file past byte ``mark`` (read outside the timed parts), once
    the writer thread has written every span that ended."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()
    return [json.loads(raw) for raw in spans.read_bytes()[mark:].splitlines()]


def _rollout_tracer(mode: str) -> trace.Tracer:
    """What the drill's dispatcher opens ``ROLLOUT_SPAN`` with, asked for afresh each window: a
    no-op tracer while no provider is installed (a bound ``ProxyTracer`` would keep recording),
    and in ``checkpoints`` mode, where a controller traces its checkpoints and not its rollouts."""
    if mode == "checkpoints":
        return trace.NoOpTracer()
    return trace.get_tracer_provider().get_tracer("midflight.bench")


async def _run_traced(cluster: InProcessCluster, tracer: trace.Tracer, rollout: str) -> None:
    attributes: dict[str, str | int] = {"midflight.rollout_id": rollout, "midflight.attempt": 0}
    with tracer.start_as_current_span(ROLLOUT_SPAN, attributes=attributes):
        reply = await cluster.run(rollout)
    if "result" not in reply:
        raise RuntimeError(f"rollout {rollout} failed: {reply}")


@asynccontextmanager
async def _cluster(root: Path, workload: Workload) -> AsyncIterator[InProcessCluster]:
    cluster = InProcessCluster(root, workload)
    async with cluster.running():
        assert cluster.http is not None
        cluster.http.event_hooks = TRACE_HOOKS  # /run carries the context, as the drill sends it
        yield cluster


async def _data_plane(
    root: Path, *, rollouts: int, concurrency: int, spans: Path, mode: str = "on"
) -> dict[str, Any]:
    """``rollouts`` rollouts, ``concurrency`` at a time: wall and CPU seconds, span lines."""
    tracer = _rollout_tracer(mode)
    async with _cluster(root, DATA_WORKLOAD) as cluster:
        names = iter(range(rollouts))

        async def loop() -> None:
            for index in names:
                await _run_traced(cluster, tracer, f"r{index:06d}")

        mark = spans.stat().st_size  # noqa: ASYNC240 (untimed: one stat, before the clock)
        wall, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as group:
            for _ in range(concurrency):
                group.start_soon(loop)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    lines = _lines_since(spans, mark)
    return {"wall_s": wall, "cpu_s": cpu, "spans": len(lines), "lines": lines}


async def _checkpoint(root: Path, *, parked: int, spans: Path, mode: str) -> dict[str, Any]:
    """``parked`` rollouts generating, then one checkpoint: its pause and span lines."""
    tracer = _rollout_tracer(mode)
    async with (
        _cluster(root, PARKED_TRACED_WORKLOAD) as cluster,
        anyio.create_task_group() as group,
    ):
        for index in range(parked):
            group.start_soon(_run_traced, cluster, tracer, f"r{index:06d}")
            if index % DISPATCH_BATCH == DISPATCH_BATCH - 1:
                await anyio.lowlevel.checkpoint()
        await wait_for(
            lambda: cluster.generations_running() >= parked,
            f"{parked} generations running",
            within_s=max(120.0, parked * 0.05),
        )
        await wait_for(cluster.every_generation_grew, "a token on every call", within_s=60.0)
        episodes = [EpisodeId(rollout_id=f"r{i:06d}", attempt=0) for i in range(parked)]
        mark = spans.stat().st_size  # noqa: ASYNC240 (untimed: one stat, before the clock)
        with checkpoint_trace("bench-tracing", participants=5):  # a no-op while off
            sample = await take_checkpoint(cluster, "bench-tracing", episodes)
        lines = _lines_since(spans, mark)
        group.cancel_scope.cancel()  # the parked rollouts end with the part
    roots = {line["trace_id"] for line in lines if line["name"] == COLLECTION_CHECKPOINT_SPAN}
    return {
        **{key: sample[key] for key in ("pause_s", "parked", "cut")},
        "spans": len(lines),
        "checkpoint_trace_spans": sum(1 for line in lines if line["trace_id"] in roots),
    }


@contextmanager
def _requests_counted() -> Iterator[list[int]]:
    """Count the requests every in-process hop sends while the block runs (untimed warm-up)."""
    counted = [0]
    serve = httpx.ASGITransport.handle_async_request

    async def counting(self: httpx.ASGITransport, request: httpx.Request) -> httpx.Response:
        counted[0] += 1
        return await serve(self, request)

    httpx.ASGITransport.handle_async_request = counting  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        httpx.ASGITransport.handle_async_request = serve  # type: ignore[method-assign]


def _per_mode(windows: list[dict[str, Any]], mode: str, key: str) -> list[float]:
    return [w[key] for w in windows if w["mode"] == mode and w.get(key) is not None]


def _round_ratios(windows: list[dict[str, Any]], key: str, mode: str = "on") -> list[float | None]:
    """Each round's ``mode`` / off: both saw the same minutes of a machine whose load drifts."""
    by = {(w["round"], w["mode"]): w[key] for w in windows}
    return [ratio(by[r, mode], by[r, "off"]) for r in sorted({w["round"] for w in windows})]


def run_tracing_bench(
    directory: Path,
    *,
    rollouts: int = 100,
    concurrency: int = 8,
    rounds: int = 5,
    parked: int = 50,
    micro_loops: int = MICRO_LOOPS,
) -> dict[str, Any]:
    """Tracing off and on over ``rounds`` alternating rounds; one JSON-ready object.

    Args:
        directory: An empty scratch directory (the runs' roots and the spans file go under it).
        rollouts: Rollouts per data-plane window.
        concurrency: Rollouts in flight in a data-plane window.
        rounds: Rounds; each runs both modes (the order flips every round).
        parked: Rollouts parked at each mode's checkpoint.
        micro_loops: Iterations of the per-span micro-loop.

    Raises:
        RuntimeError: Tracing is already on in this process (off would not be off).
    """
    if tracing_on():
        raise RuntimeError("a tracer provider is installed already: the off mode would trace")
    loadavg = load_average()
    tracing = _bench_tracing()
    files = SpansFileExporter(directory / "spans", SERVICE)
    spans = files.path
    tracing.exporter.target = files
    calls = DATA_WORKLOAD.activations * DATA_WORKLOAD.turns

    async def main() -> tuple[int, list[dict[str, Any]]]:
        with _requests_counted() as counted:  # warm-up, untimed: the first apps pay the imports
            await _data_plane(
                directory / "warmup", rollouts=concurrency, concurrency=concurrency, spans=spans
            )
        windows = []
        for index in range(rounds):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                root = directory / f"round{index}-{mode}"
                with _mode(mode, tracing):
                    plane = await _data_plane(
                        root / "plane",
                        rollouts=rollouts,
                        concurrency=concurrency,
                        spans=spans,
                        mode=mode,
                    )
                    point = await _checkpoint(
                        root / "checkpoint", parked=parked, spans=spans, mode=mode
                    )
                servers = sum(1 for line in plane.pop("lines") if line["kind"] == "SERVER")
                windows.append(
                    {
                        "round": index,
                        "mode": mode,
                        "us_per_call": plane["wall_s"] / (rollouts * calls) * 1e6,
                        "cpu_us_per_call": plane["cpu_s"] / (rollouts * calls) * 1e6,
                        "spans": plane["spans"],
                        "spans_per_rollout": plane["spans"] / rollouts,
                        "server_spans_per_rollout": servers / rollouts,
                        "checkpoint_s": point["pause_s"],
                        "checkpoint_parked": point["parked"],
                        "checkpoint_cut": point["cut"],
                        "checkpoint_spans": point["spans"],
                        "checkpoint_trace_spans": point["checkpoint_trace_spans"],
                    }
                )
        return counted[0], windows

    try:
        requests, windows = anyio.run(main)
        micro = span_costs(lambda: _mode("on", tracing), micro_loops)
    finally:
        _install(None)
        tracing.exporter.target = None
        files.shutdown()

    def each(key: str) -> tuple[float, float, float]:
        off, checkpoints, on = (round(median(_per_mode(windows, m, key)), 3) for m in MODES)
        return off, checkpoints, on

    (off, only, on), (off_cpu, only_cpu, on_cpu), (off_pause, only_pause, on_pause) = (
        each(key) for key in ("us_per_call", "cpu_us_per_call", "checkpoint_s")
    )
    return {
        "suite": "tracing",
        "parking": PARKING,
        "floor": FLOOR,
        "on": "the SDK provider, its spans written by a thread to a JSON-lines file as each ends (as "
        "--trace-dir installs), every rollout inside a ROLLOUT_SPAN: everything traced",
        "loadavg": loadavg,
        "loadavg_end": load_average(),
        "rounds": rounds,
        "rollouts": rollouts,
        "concurrency": concurrency,
        "parked": parked,
        "calls_per_rollout": calls,
        "http_requests_per_rollout": round(requests / concurrency, 2),
        "off_us_per_call": off,
        "on_us_per_call": on,
        "overhead_us_per_call": round(on - off, 3),
        "ratio": ratio(on, off),
        "round_ratios": _round_ratios(windows, "us_per_call"),
        "round_cpu_ratios": _round_ratios(windows, "cpu_us_per_call"),
        "off_cpu_us_per_call": off_cpu,
        "on_cpu_us_per_call": on_cpu,
        "cpu_overhead_us_per_call": round(on_cpu - off_cpu, 3),
        "cpu_ratio": ratio(on_cpu, off_cpu),
        "checkpoints_us_per_call": only,
        "checkpoints_overhead_us_per_call": round(only - off, 3),
        "checkpoints_ratio": ratio(only, off),
        "checkpoints_cpu_us_per_call": only_cpu,
        "checkpoints_spans_per_rollout": median(
            _per_mode(windows, "checkpoints", "spans_per_rollout")
        ),
        "checkpoint_checkpoints_s": only_pause,
        "off_us_per_rollout": round(off * calls, 3),
        "on_us_per_rollout": round(on * calls, 3),
        "checkpoint_off_s": off_pause,
        "checkpoint_on_s": on_pause,
        "checkpoint_ratio": ratio(on_pause, off_pause),
        "spans_per_rollout": median(_per_mode(windows, "on", "spans_per_rollout")),
        "server_spans_per_rollout": median(_per_mode(windows, "on", "server_spans_per_rollout")),
        "spans_per_checkpoint": median(_per_mode(windows, "on", "checkpoint_spans")),
        "checkpoint_trace_spans": median(_per_mode(windows, "on", "checkpoint_trace_spans")),
        "off_spans": sum(w["spans"] + w["checkpoint_spans"] for w in windows if w["mode"] == "off"),
        "span_call": micro,
        "spans_file": str(files.path.relative_to(directory)),
        "windows": [
            {k: round(v, 6) if isinstance(v, float) else v for k, v in w.items()} for w in windows
        ],
    }
