"""What the prepare, commit, restore and retire procedures may use of their control plane, and nothing more.

The procedures run inside the plane's lock and phase machine, so they need a handful of its
members; naming them in one protocol keeps the plane and its procedures free of an import cycle
(the plane builds the procedures; they know the plane only as :class:`PlaneAccess`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar

import anyio
from anyio.abc import TaskGroup
from pydantic import BaseModel

from protocols import CheckpointRequest, Phase, PhaseEvent, PrepareReport

from .clock import Clock
from .marks import RetireMarks
from .participant import Participant
from .settings import ControlSettings
from .telemetry import ControlTelemetry

R = TypeVar("R", bound=BaseModel)
Q = TypeVar("Q", bound=CheckpointRequest)


class PlaneAccess(Protocol):
    """The members of :class:`~participants.ControlPlane` its procedures use."""

    participant: Participant
    settings: ControlSettings
    clock: Clock
    telemetry: ControlTelemetry
    marks: RetireMarks
    checkpoint_id: str | None
    phase: Phase
    lock: anyio.Lock

    @property
    def task_group(self) -> TaskGroup:
        """The plane's task group, where background jobs run."""
        ...

    def bounded(self, request: Q) -> Q:
        """``request`` with its deadline held to the plane's horizon."""
        ...

    def admit(
        self, checkpoint_id: str, event: PhaseEvent, args: Hashable = None
    ) -> BaseModel | None:
        """Check the call against the phase machine; a stored reply when it is a replay."""
        ...

    def store_result(self, checkpoint_id: str, event: PhaseEvent, args: Hashable, reply: R) -> R:
        """Remember ``reply`` for a replay of the same call."""
        ...

    def stored_result(self, checkpoint_id: str, event: PhaseEvent) -> BaseModel | None:
        """The reply stored for ``event`` of ``checkpoint_id``, if any."""
        ...

    def transition(self, event: PhaseEvent) -> None:
        """Move the phase machine by ``event``."""
        ...

    def renew_lease(self, deadline_ts: float) -> None:
        """Extend the lease to ``deadline_ts`` plus the grace."""
        ...

    def report(self) -> PrepareReport:
        """The participant's readiness report."""
        ...

    async def abandon_prepare(self) -> None:
        """Reopen admission after a failed close or readiness wait; the id may try again."""
        ...

    async def expire_lease_if_due(self) -> None:
        """Abandon the checkpoint when its lease has run out."""
        ...
