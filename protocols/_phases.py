"""The participant phase machine, as data, and the fixed coordination orders.

Each participant is in one phase at a time. ``PHASE_TRANSITIONS`` lists every allowed
``(phase, event) -> phase`` step; anything not in the table is refused. ``ALLOWED_PHASES`` says
which phases admit each control operation (the third admission check, after the stale-id and
conflict checks).
"""

from __future__ import annotations

from enum import StrEnum
from types import MappingProxyType
from typing import Final, Literal

from ._errors import InvalidPhaseError


class Phase(StrEnum):
    """The phase of one participant."""

    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class PhaseEvent(StrEnum):
    """What moves a participant from one phase to another."""

    PREPARE = "prepare"
    READY = "ready"
    COMMIT = "commit"
    RESTORE = "restore"
    RESUME = "resume"
    LEASE_EXPIRED = "lease_expired"
    RENEW = "renew"
    RETIRE = "retire"
    FORGET = "forget"


ParticipantKind = Literal["environment", "model", "agent", "resources"]
"""The four kinds of participant."""

PARTICIPANT_KINDS: Final[tuple[ParticipantKind, ...]] = (
    "environment",
    "model",
    "agent",
    "resources",
)

PREPARE_ORDER: Final[tuple[ParticipantKind, ...]] = ("environment", "model", "agent", "resources")
"""Prepare stage by stage in this order; resume in the reverse."""

RETIRE_ORDER: Final[tuple[tuple[ParticipantKind, ...], ...]] = (
    ("environment",),
    ("agent",),
    ("model", "resources"),
)
"""Retire and forget group by group, callers before callees; a group runs concurrently."""

RESUME_ORDER: Final[tuple[ParticipantKind, ...]] = tuple(reversed(PREPARE_ORDER))
"""Resume reopens callees before their callers."""

_OPEN: Final = (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED)


def _build() -> dict[tuple[Phase, PhaseEvent], Phase]:
    table: dict[tuple[Phase, PhaseEvent], Phase] = {
        (Phase.IDLE, PhaseEvent.PREPARE): Phase.PREPARING,
        (Phase.PREPARING, PhaseEvent.PREPARE): Phase.PREPARING,
        (Phase.PREPARING, PhaseEvent.READY): Phase.PREPARED,
        (Phase.PREPARED, PhaseEvent.COMMIT): Phase.COMMITTED,
        (Phase.IDLE, PhaseEvent.RESTORE): Phase.RESTORED,
        (Phase.IDLE, PhaseEvent.RETIRE): Phase.IDLE,
        (Phase.RESTORED, PhaseEvent.RETIRE): Phase.RESTORED,
        (Phase.IDLE, PhaseEvent.FORGET): Phase.IDLE,
        (Phase.RESTORED, PhaseEvent.FORGET): Phase.RESTORED,
    }
    for phase in _OPEN:
        table[(phase, PhaseEvent.RESUME)] = Phase.IDLE
        table[(phase, PhaseEvent.LEASE_EXPIRED)] = Phase.IDLE
        table[(phase, PhaseEvent.RENEW)] = phase
    return table


PHASE_TRANSITIONS: Final = MappingProxyType(_build())
"""Every allowed ``(phase, event) -> next phase``."""

ALLOWED_PHASES: Final = MappingProxyType(
    {
        event: frozenset(phase for (phase, e) in PHASE_TRANSITIONS if e is event)
        for event in PhaseEvent
    }
)
"""For each event, the phases that admit it."""

OPEN_PHASES: Final = frozenset(_OPEN)
"""The phases in which a checkpoint (or a restore) is open and admission is closed."""


def next_phase(phase: Phase, event: PhaseEvent) -> Phase:
    """The phase after ``event`` in ``phase``.

    Raises:
        InvalidPhaseError: The table does not allow ``event`` in ``phase``.
    """
    try:
        return PHASE_TRANSITIONS[(phase, event)]
    except KeyError:
        allowed = ", ".join(sorted(ALLOWED_PHASES[event])) or "no phase"
        raise InvalidPhaseError(
            f"{event.value} is not allowed in phase {phase.value} (allowed in: {allowed})"
        ) from None
