"""Building a prepare report the way every participant kind must: sorted, capped, counted."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from protocols import MAX_REPORTED_BLOCKERS, PrepareReport


def build_report(
    blockers: Iterable[str],
    *,
    counts: Mapping[str, int] | None = None,
    restarts: Iterable[str] = (),
) -> PrepareReport:
    """A readiness report: ready iff nothing blocks; the first 100 blockers listed, all counted.

    Args:
        blockers: Capture keys that prevent a safe cut now (any order, duplicates ignored).
        counts: Kind-specific tallies.
        restarts: Capture keys of in-flight episodes this participant cannot capture (uncapped).
    """
    unique = sorted(set(blockers))
    return PrepareReport(
        ready=not unique,
        blockers=unique[:MAX_REPORTED_BLOCKERS],
        blocker_count=len(unique),
        counts=dict(counts or {}),
        restarts=sorted(set(restarts)),
    )
