"""Test hooks of ``coordinator``: the publication fault switches, for tests and drills only.

Nothing here belongs in a training controller; the names live outside the package's curated
``__all__`` so that a user never meets them by accident.
"""

from __future__ import annotations

from ._publish import PUBLISH_FAULTS

__all__ = [
    "PUBLISH_FAULTS",
]
