"""The drill's own failures: each is one line (or one JSON object) for its user, never a
traceback (D254, D366, D373)."""

from __future__ import annotations

from protocols import MidflightError


class DrillRunError(MidflightError, RuntimeError):
    """The drill could not run to its figures (one line for its user, never a traceback)."""


class DrillStalledError(DrillRunError):
    """A phase's controller exited early or made no progress within the phase timeout."""


class DrillBaselineError(DrillRunError):
    """The baseline did not finish every rollout, so the run has nothing to be compared with."""
