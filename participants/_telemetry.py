"""What the control plane tells operators: one structlog event per operation, and metrics.

Each server gets its own prometheus registry, so several participants can live in one test
process. Event names come from a fixed vocabulary (``CONTROL_EVENTS``); tokens are never logged.
"""

from __future__ import annotations

from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocols import Phase

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

    def event(self, name: str, **context: Any) -> None:
        """Record a control-plane event that is not an operation reply."""
        self.events.labels(event=name).inc()
        self.log.warning(f"checkpoint.{name}", **context)
