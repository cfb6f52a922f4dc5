"""The baseline's directory: its markers, whether it may be reused or removed, and why a short
one fails the drill (D156, D369, D373).

The baseline run itself and its key stay in ``run`` (``_baseline``, ``baseline_key``): they start
a cluster and read the drill's options, as the run does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._servers.evidence import read_evidence
from .loop_stalls import loop_stalls

BASELINE_MARKER = "baseline.json"
"""Written into a baseline directory once its run finished: what its outcomes depend on."""
BASELINE_STARTED = "baseline-started"
"""Written into a baseline directory before its run starts: a drill may remove what it holds."""


def check_baseline_dir(directory: Path) -> None:
    """Refuse a baseline directory the drill could neither reuse nor remove (D369).

    Raises:
        ValueError: ``directory`` is a file or a link, holds a torn ``baseline.json``, or holds
            files no drill wrote (an unfinished baseline is removed and run again whole).
    """
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"--baseline {directory} is not a directory")
    if not directory.exists():
        return
    if (directory / BASELINE_MARKER).exists():
        finished_baseline(directory / BASELINE_MARKER)
    elif not (directory / BASELINE_STARTED).exists() and any(directory.iterdir()):
        raise ValueError(
            f"--baseline {directory} holds files that are no drill's baseline: name a new or "
            "empty directory"
        )


def finished_baseline(marker: Path) -> dict[str, Any]:
    """The finished baseline's record; ValueError when it is not one this drill wrote."""
    try:
        recorded = json.loads(marker.read_text())
        if isinstance(recorded, dict) and {"key", "wall_s"} <= recorded.keys():
            float(recorded["wall_s"])
            return recorded
    except (OSError, ValueError, TypeError):  # unreadable, not JSON, or of the wrong shape
        pass
    raise ValueError(f"{marker} is not a finished baseline's record: remove it, or name another")


def baseline_shortfall(directory: Path, finished: int, rollouts: int) -> str:
    """Why a baseline in ``directory`` finished only ``finished`` of ``rollouts`` (D373)."""
    failed = [
        e
        for e in read_evidence(directory / "evidence" / "driver.jsonl")
        if e.get("event") == "run_failed"
    ]
    first = ""
    if failed:
        failure = failed[0].get("failure") or {}
        code = failure.get("code") or failed[0].get("code") or f"HTTP {failed[0].get('status')}"
        detail = failure.get("detail")
        first = f" (the first: {code}: {detail})" if detail else f" (the first: {code})"
    return (
        f"the baseline finished {finished:,} of {rollouts:,} rollouts; {len(failed):,} ended in "
        f"a failure{first}. The servers could not carry this load, so there is nothing to "
        "compare the run with: run fewer rollouts at once (--concurrency), or on more cores."
    ) + loop_stalls(directory / "logs").sentence(directory / "logs")
