"""What a drill runs: its options, its fault switches, and the defaults that scale with its size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .store import DISK

FAULTS = {
    "rerun-from-input": "repeated_model_calls",
    "skip-ledger-import": "token_mismatches",
    "no-restore-fence": "stale_accepted",
    "export-undelivered": "repeated_model_calls",
    "ignore-cuts": "extra_tokens_generated",
    "continue-without-prefix": "continuation_redecode_mismatches",
}
"""Fault switch → the figure it must turn non-zero (skip-ledger-import: or ``lost``;
continue-without-prefix: on a model engine, and ``token_mismatches`` on the deterministic one)."""

RESTART_AGENT: Final = "agent-restart"
RESTART_ENVIRONMENT: Final = "environment-restart"
"""The second agent (restart-only) and the environment that drives it."""


MAX_DEFAULT_CONCURRENCY: Final = 256


def default_concurrency(rollouts: int) -> int:
    """Rollouts in flight when ``--concurrency`` is not given: 4 for the small drills, a quarter
    of the rollouts for the large ones (at most 256), so a thousand rollouts run hundreds at a
    time through real processes instead of four at a time."""
    return max(4, min(rollouts // 4, MAX_DEFAULT_CONCURRENCY))


@dataclass(frozen=True)
class DrillOptions:
    """What ``midflight drill`` runs."""

    rollouts: int = 8
    checkpoints: int = 3
    crashes: int = 2
    seed: int = 0
    token_delay_ms: float = 4.0
    activations: int = 2
    turns: int = 2
    max_tokens: int = 32
    concurrency: int = 4
    fault: str | None = None
    phase_timeout_s: float = 120.0
    """How long a phase may show no sign of life: no line from its controller (one per accepted
    rollout) and no new evidence from any server (one line per model call; D375)."""
    verify: str = "wait"
    resources_mode: str = "exported"
    restart_only_share: float = 0.2
    processes: int = 1
    """``--processes``: shard processes per server but the inference worker (1: none)."""
    engine: str = "deterministic"
    """``--engine``: the inference worker's engine."""
    model: str | None = None
    """``--model``: the model directory of a model engine (the tiny model, built, when none)."""
    dtype: str = "float64"
    """``--dtype``: a model engine's floating-point type."""
    trace_dir: str | None = None
    """``--trace-dir``: every process of the run (not the baseline's) appends its spans there."""
    checkpoint_store: str = DISK
    """``--checkpoint-store``: ``disk``, ``s3`` (a local S3 server) or ``s3://bucket/prefix``."""
    on: str = "local"
    """``--on``: ``local`` (a process group per server) or ``ray`` (an actor per server)."""

    @property
    def model_engine(self) -> bool:
        """Whether the worker runs a real model (every engine but the deterministic one)."""
        return self.engine != "deterministic"

    def worker_options(self) -> dict[str, Any]:
        """The worker's role options: the deterministic engine's stay as they always were."""
        options: dict[str, Any] = {"token_delay_ms": self.token_delay_ms, "seed": self.seed}
        if self.model_engine:
            options.update(engine=self.engine, model=self.model, dtype=self.dtype)
        return options

    def task_input(self) -> dict[str, int]:
        """The counter task every rollout runs (what its tokens and reward depend on)."""
        return {
            "activations": self.activations,
            "turns": self.turns,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }


MULTI_PROCESS_ROLES: Final = ("model", "resources", "agent", "environment")
"""The roles ``--processes N`` runs as N shard processes (the inference worker keeps one)."""


def process_options(processes: int) -> dict[str, Any]:
    """The role option that asks for ``processes`` shards; none for the single-process path.

    The key stays ``workers`` (the cluster-file spelling of the e2e contract, §1): the
    supervisor passes it as ``--workers N``, the same option as ``--processes N``.
    """
    return {"workers": processes} if processes > 1 else {}


def restart_only_rollouts(rollouts: list[str], share: float) -> list[str]:
    """The rollouts run through the restart-only agent: ``round(share * n)``, at least one for a
    positive share, spread evenly over the list."""
    if share <= 0 or not rollouts:
        return []
    count = min(len(rollouts), max(1, round(share * len(rollouts))))
    return [rollouts[(k * len(rollouts)) // count] for k in range(count)]
