"""Test hooks of ``participants``: fault switches and kill points, for tests and drills only.

Nothing here belongs in a production server; the names live outside the package's
curated ``__all__`` so that a user never meets them by accident.
"""

from __future__ import annotations

from ._ledger.removal import RETIRE_STEPS
from ._model.participant import MODEL_FAULTS
from ._runtime.kill_points import KILL_FILE_ENV, KILL_POINT_ENV, TEST_HOOKS_ENV, KillPoint

__all__ = [
    "KILL_FILE_ENV",
    "KILL_POINT_ENV",
    "MODEL_FAULTS",
    "RETIRE_STEPS",
    "TEST_HOOKS_ENV",
    "KillPoint",
]
