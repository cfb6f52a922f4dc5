"""The phase machine, walked cell by cell, and the fixed orders."""

from __future__ import annotations

import itertools

import pytest

from protocols import (
    ALLOWED_PHASES,
    PHASE_TRANSITIONS,
    PREPARE_ORDER,
    RESUME_ORDER,
    RETIRE_ORDER,
    InvalidPhaseError,
    Phase,
    PhaseEvent,
    next_phase,
)
from protocols._phases import OPEN_PHASES

ID, PG, PD, C, R = (Phase.IDLE, Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED)
E = PhaseEvent

# The table of control-plane §3.1/§3.2, written out independently of the code.
EXPECTED = {
    (ID, E.PREPARE): PG,
    (PG, E.PREPARE): PG,
    (PG, E.READY): PD,
    (PD, E.COMMIT): C,
    (ID, E.RESTORE): R,
    (ID, E.RETIRE): ID,
    (R, E.RETIRE): R,
    (ID, E.FORGET): ID,
    (R, E.FORGET): R,
    **{(p, E.RESUME): ID for p in (PG, PD, C, R)},
    **{(p, E.LEASE_EXPIRED): ID for p in (PG, PD, C, R)},
    **{(p, E.RENEW): p for p in (PG, PD, C, R)},
}


def test_the_table_is_exactly_the_reference() -> None:
    assert dict(PHASE_TRANSITIONS) == EXPECTED


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, PhaseEvent)))
def test_every_cell(phase: Phase, event: PhaseEvent) -> None:
    if (phase, event) in EXPECTED:
        assert next_phase(phase, event) is EXPECTED[(phase, event)]
        assert phase in ALLOWED_PHASES[event]
    else:
        with pytest.raises(InvalidPhaseError):
            next_phase(phase, event)
        assert phase not in ALLOWED_PHASES[event]


def test_open_phases_are_every_phase_but_idle() -> None:
    assert frozenset(Phase) - OPEN_PHASES == {Phase.IDLE}


def test_orders() -> None:
    assert PREPARE_ORDER == ("environment", "model", "agent", "resources")
    assert RESUME_ORDER == ("resources", "agent", "model", "environment")
    assert RETIRE_ORDER == (("environment",), ("agent",), ("model", "resources"))
