"""What one driver incarnation is told (its plan) and what it keeps (its own checkpointed state)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class DriverPlan:
    """What one driver process does before it exits or asks to be crashed."""

    rollouts: list[str]
    task_input: dict[str, Any]
    phase: int
    checkpoints: int
    crash_after: bool
    concurrency: int = 4
    fault: str | None = None
    commit_delay_s: float = 0.3
    restart_only_rollouts: list[str] = field(default_factory=list)
    restart_environment: str = ""
    checkpoint_root: str = ""
    """Where checkpoints are kept when not in the run root: an ``s3://`` URL."""

    @classmethod
    def load(cls, path: Path) -> DriverPlan:
        """Read a plan file."""
        return cls(**json.loads(path.read_text()))


@dataclass
class ControllerState:
    """The controller's own state, checkpointed with the participants'."""

    accepted: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "attempts": self.attempts}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ControllerState:
        return cls(accepted=dict(data.get("accepted", {})), attempts=dict(data.get("attempts", {})))


def task_of(rollout: str, task_input: Mapping[str, Any]) -> dict[str, Any]:
    return {"task_id": {"taskset": "counter", "task_id": rollout}, "task_input": dict(task_input)}


def _error(reply: httpx.Response) -> dict[str, Any]:
    """The error envelope's ``error`` object of a refusal; empty for anything else."""
    if reply.status_code < 400:
        return {}
    try:
        body = reply.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def error_code(reply: httpx.Response) -> str | None:
    """The code of a refusal's error envelope; ``None`` for anything else."""
    code = _error(reply).get("code")
    return code if isinstance(code, str) else None


def error_detail(reply: httpx.Response) -> str | None:
    """The detail of a refusal's error envelope (at most 500 characters), for the evidence."""
    detail = _error(reply).get("detail")
    return detail[:500] if isinstance(detail, str) else None
