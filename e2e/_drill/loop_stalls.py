"""The event-loop stalls a drill's servers and controller logged (D406, D410), read back from
their logs.

Every server process, and the drill's controller, logs ``event_loop_stalled`` when its loop turns
again after a second or more (``e2e/_launch/loop_watch.py``). A drill's figures say how many there were and where the
longest one held its loop, and a baseline that could not finish says the same, so a run at
thousands in flight that ends in deadlines names the stalls that may explain them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

EVENT: Final = "event_loop_stalled"


@dataclass(frozen=True)
class LoopStalls:
    """The stalls logged under one ``logs`` directory."""

    count: int = 0
    longest_s: float = 0.0
    where: str = ""
    """``<log> <process>: <innermost frame of the most sampled stack>`` of the longest stall."""
    seconds: float = 0.0
    """Every stall's ``stalled_s``, summed."""
    gc_s: float = 0.0
    """Every stall's ``gc_s`` (the garbage collector's share of it, D411), summed."""

    def figures(self) -> dict[str, Any]:
        """The drill's figures: ``loop_stalls``, the longest and where it was, the stalls'
        seconds summed and the collector's part of them."""
        return {
            "loop_stalls": self.count,
            "loop_stall_longest_s": self.longest_s,
            "loop_stall_longest_where": self.where,
            "loop_stall_s": self.seconds,
            "loop_stall_gc_s": self.gc_s,
        }

    def sentence(self, logs: Path) -> str:
        """What a failure message adds: nothing without a stall."""
        if not self.count:
            return ""
        times = "once" if self.count == 1 else f"{self.count:,} times"
        return (
            f" The servers' event loops stalled {times}, the longest {self.longest_s:.1f} s "
            f"({self.where}), {self.seconds:.1f} s in all, {self.gc_s:.1f} s of it in garbage "
            f"collections; see {EVENT} in {logs}."
        )


def loop_stalls(logs: Path) -> LoopStalls:
    """Count the ``event_loop_stalled`` events of every ``*.log`` in ``logs`` (none: zeros)."""
    count, longest, where, total, collecting = 0, 0.0, "", 0.0, 0.0
    for path in sorted(logs.glob("*.log")):
        with path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if EVENT not in line:  # most lines: no JSON parse
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict) or event.get("event") != EVENT:
                    continue
                seconds = float(event.get("stalled_s") or 0.0)
                count += 1
                total += seconds
                collecting += float(event.get("gc_s") or 0.0)
                if seconds > longest:
                    longest = seconds
                    where = f"{path.stem} {event.get('process', '?')}{_innermost(event)}"
    return LoopStalls(count, round(longest, 3), where, round(total, 3), round(collecting, 3))


def _innermost(event: dict[str, Any]) -> str:
    """``: <frame>``, the innermost frame of the most sampled stack; ``""`` with none."""
    stacks = event.get("stacks")
    if isinstance(stacks, list) and stacks and isinstance(stacks[0], dict):
        frames = stacks[0].get("frames")
        if isinstance(frames, list) and frames:
            return f": {frames[0]}"
    return ""


__all__ = ["LoopStalls", "loop_stalls"]
