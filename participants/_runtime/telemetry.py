"""What the control plane tells operators: one structlog event per operation, and metrics.

Each server gets its own prometheus registry, so several participants can live in one test
process. Event names come from a fixed vocabulary (``CONTROL_EVENTS``); tokens are never logged.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal, TypeVar

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocols import (
    CommitReply,
    Phase,
    PrepareReply,
    RestoreReply,
    WireError,
    operation_span,
)

from .._tracing import checkpoint_span, set_checkpoint_attributes

T = TypeVar("T")

CONTROL_EVENTS: Final = frozenset(
    {
        "checkpoint.status",
        "checkpoint.prepare",
        "checkpoint.renew",
        "checkpoint.commit",
        "checkpoint.restore",
        "checkpoint.resume",
        "checkpoint.retire",
        "checkpoint.forget",
        "checkpoint.lease_expired",
        "checkpoint.prepare_not_ready",
        "checkpoint.park_exported_failed",
        "checkpoint.reopen_after_install",
    }
)


class ControlTelemetry:
    """Metrics and the bound logger of one participant's control plane.

    Args:
        kind: The participant kind (a label on every event).
        instance: The participant instance.
        registry: Where the metrics live; a new registry when omitted.
    """

    def __init__(self, kind: str, instance: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.kind = kind
        self.instance = instance
        self.log = structlog.get_logger("midflight.control").bind(participant=f"{kind}/{instance}")
        self.operations = Counter(
            "midflight_checkpoint_operations",
            "Control operations handled, by operation and outcome.",
            ["operation", "outcome"],
            registry=self.registry,
        )
        self.durations = Histogram(
            "midflight_checkpoint_operation_seconds",
            "Duration of control operations, by operation and outcome.",
            ["operation", "outcome"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.refusals = Counter(
            "midflight_checkpoint_refusals",
            "Control operations refused, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.events = Counter(
            "midflight_checkpoint_events",
            "Control-plane events (lease_expired, prepare_not_ready, ...).",
            ["event"],
            registry=self.registry,
        )
        self.records = Counter(
            "midflight_checkpoint_records",
            "Records a commit wrote or a restore read, by operation.",
            ["operation"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "midflight_checkpoint_bytes",
            "Bytes of records a commit wrote or a restore read, by operation.",
            ["operation"],
            registry=self.registry,
        )
        for moving in ("commit", "restore"):  # both scrape from the start, at zero
            self.records.labels(operation=moving)
            self.bytes.labels(operation=moving)
        self.phase = Gauge(
            "midflight_checkpoint_phase",
            "1 for the participant's current phase, 0 for the others.",
            ["phase"],
            registry=self.registry,
        )
        self.set_phase(Phase.IDLE)

    def set_phase(self, phase: Phase) -> None:
        """Publish the current phase."""
        for candidate in Phase:
            self.phase.labels(phase=candidate.value).set(1 if candidate is phase else 0)

    def moved(self, operation: str, *, records: int, size: int) -> None:
        """Count the records (and their bytes) one commit wrote or one restore read."""
        self.records.labels(operation=operation).inc(records)
        self.bytes.labels(operation=operation).inc(size)

    def operation(
        self,
        operation: str,
        *,
        outcome: str,
        seconds: float,
        code: str | None = None,
        **context: Any,
    ) -> None:
        """Record one finished operation: counters, duration, and one log event."""
        self.operations.labels(operation=operation, outcome=outcome).inc()
        self.durations.labels(operation=operation, outcome=outcome).observe(seconds)
        if code is not None:
            self.refusals.labels(code=code).inc()
        event = f"checkpoint.{operation}"
        if outcome == "ok":
            self.log.info(event, outcome=outcome, seconds=round(seconds, 6), **context)
        else:
            self.log.warning(
                event, outcome=outcome, code=code, seconds=round(seconds, 6), **context
            )

    async def instrumented(
        self,
        operation: str,
        checkpoint_id: str | None,
        work: Callable[[], Awaitable[T]],
        *,
        phase: Callable[[], str],
    ) -> T:
        """Run ``work`` and record its outcome: ``ok``, ``refused`` (a coded error) or ``error``.

        ``phase`` is read after the work, so the event names the phase it left behind.
        """
        started = time.perf_counter()
        with checkpoint_span(
            operation_span(operation),
            id=checkpoint_id,
            participant_kind=self.kind,
            instance=self.instance,
        ) as span:
            try:
                reply = await work()
            except WireError as exc:
                set_checkpoint_attributes(span, phase=phase())
                self.operation(
                    operation,
                    outcome="refused",
                    code=exc.code,
                    seconds=time.perf_counter() - started,
                    checkpoint_id=checkpoint_id,
                    phase=phase(),
                    detail=exc.detail,
                )
                raise
            except Exception:
                set_checkpoint_attributes(span, phase=phase())
                self.operation(
                    operation,
                    outcome="error",
                    code="internal_error",
                    seconds=time.perf_counter() - started,
                    checkpoint_id=checkpoint_id,
                    phase=phase(),
                )
                raise
            set_checkpoint_attributes(span, phase=phase(), outcome="ok", **reply_attributes(reply))
        self.operation(
            operation,
            outcome="ok",
            seconds=time.perf_counter() - started,
            checkpoint_id=checkpoint_id,
            phase=phase(),
        )
        return reply

    def event(self, name: str, **context: Any) -> None:
        """Record a control-plane event that is not an operation reply."""
        self.events.labels(event=name).inc()
        self.log.warning(f"checkpoint.{name}", **context)


def reply_attributes(reply: object) -> dict[str, Any]:
    """What a reply tells a span: blockers of a prepare, records and episodes of a commit."""
    if isinstance(reply, PrepareReply):
        return {
            "prepared": reply.phase is Phase.PREPARED,
            "blockers": reply.report.blocker_count or len(reply.report.blockers),
        }
    if isinstance(reply, CommitReply):
        return {"records": reply.manifest.record_count, "episodes": len(reply.episode_ids)}
    if isinstance(reply, RestoreReply):
        return {"episodes": len(reply.restored)}
    return {}


GENERATION_CUT_OUTCOMES: Final = ("cut", "failed", "skipped", "continued", "refused")
"""Labels of ``midflight_generation_cuts_total``: what became of a call's cut.

``cut``, ``failed`` and ``skipped`` (constrained decoding) are counted per call at each cut round;
``continued`` when a re-issued call hands its restored cut to the worker and the worker accepts
it, ``refused`` when the worker refuses it and the call regenerates.
"""


class GenerationCutTelemetry:
    """The policy server's generation-cut counter and its events.

    One ``generation_cut.round`` event per cut round (a warning when a worker's round failed),
    one ``generation_cut.continued`` / ``generation_cut.refused`` event per restored cut offered
    to a worker.

    Args:
        instance: The model participant's instance (bound on every event).
        registry: The server's registry (the control plane's, so ``/metrics`` shows it).
    """

    def __init__(self, instance: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.log = structlog.get_logger("midflight.model").bind(participant=f"model/{instance}")
        self.cuts = Counter(
            "midflight_generation_cuts",
            "Generation cuts by outcome: cut, failed, skipped, continued, refused.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in GENERATION_CUT_OUTCOMES:  # every outcome scrapes, zero until it happens
            self.cuts.labels(outcome=outcome)

    def cut_round(
        self, checkpoint_id: str, counts: Mapping[str, int], failures: Mapping[str, str]
    ) -> None:
        """Record one cut round: ``counts`` of ``cut``/``cut_failed``/``cut_skipped`` calls and the
        error of each worker whose whole round failed."""
        for outcome, name in (("cut", "cut"), ("failed", "cut_failed"), ("skipped", "cut_skipped")):
            if counts.get(name, 0):
                self.cuts.labels(outcome=outcome).inc(counts[name])
        context = {
            "checkpoint_id": checkpoint_id,
            "calls": sum(counts.values()),
            **counts,
            "failed_workers": dict(sorted(failures.items())),
        }
        if failures or counts.get("cut_failed", 0):
            # Not an error: those calls regenerate after a restore. Operators see why.
            self.log.warning("generation_cut.round", **context)
        else:
            self.log.info("generation_cut.round", **context)

    def continuation(
        self, outcome: Literal["continued", "refused"], capture_key: str, model_call_id: str
    ) -> None:
        """Record a restored cut the worker accepted (``continued``) or refused."""
        self.cuts.labels(outcome=outcome).inc()
        event = f"generation_cut.{outcome}"
        if outcome == "continued":
            self.log.info(event, capture_key=capture_key, model_call_id=model_call_id)
        else:
            self.log.warning(event, capture_key=capture_key, model_call_id=model_call_id)
