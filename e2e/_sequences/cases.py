"""Named sequence cases: interleavings that once failed, frozen so they run the same way every time.

``midflight drill --sequence-case NAME`` runs one of them instead of a seeded plan. A case is a
plan as ``plan_sequence`` writes one, with its ``block`` marks chosen by hand, so it does not move
when the plan generator changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

NAMED_CASES: Final[Mapping[str, list[dict[str, Any]]]] = {
    # Issue 18: seed 22's plan at the reference's size, frozen. The checkpoint of the second
    # crash (index 5), right after the first restore, is blocked by the first attempt of its
    # scope (r000-a2, restored): the controller resumes, retires it, reruns it from input as
    # r000-a3, crashes and restores the first checkpoint again, so every restored attempt runs
    # in a second incarnation (D218, D219, D220).
    "blocked-after-restore": [
        {"op": "start", "count": 1},
        {"op": "start", "count": 3},
        {"op": "retire", "pick": 0.184},
        {"op": "start", "count": 3},
        {"op": "crash"},
        {"op": "crash", "block": 0.0},
        {"op": "start", "count": 2},
        {"op": "retire", "pick": 0.319},
        {"op": "checkpoint"},
        {"op": "retire", "pick": 0.685},
        {"op": "retire", "pick": 0.708},
        {"op": "start", "count": 1},
        {"op": "checkpoint"},
        {"op": "start", "count": 1},
        {"op": "start", "count": 1},
        {"op": "checkpoint"},
        {"op": "retire", "pick": 0.774},
        {"op": "retire", "pick": 0.566},
        {"op": "checkpoint"},
        {"op": "checkpoint"},
        {"op": "start", "count": 2},
        {"op": "start", "count": 3},
        {"op": "checkpoint"},
        {"op": "start", "count": 2},
        {"op": "checkpoint"},
        {"op": "start", "count": 1},
        {"op": "finish"},
        {"op": "checkpoint"},
        {"op": "finish"},
        {"op": "start", "count": 2},
    ],
}
"""Interleavings that once failed, forced every time (``--sequence-case NAME``)."""
