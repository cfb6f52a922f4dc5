"""Pause Python's cyclic garbage collector while a checkpoint holds admission closed.

With thousands of rollouts in flight a server holds millions of tracked objects, and one full
(generation 2) collection walks all of them: the checkpoint bench measured a single one at 2 s
with 4,000 rollouts parked, triggered by the allocations of the cut round itself. Reference
counting still frees everything acyclic; only the cycle collector waits. While any control plane
of the process is outside ``IDLE`` (prepared, committing, restored) the collector is paused, and
the last one to return to ``IDLE`` (or to stop) gives it back as it found it (D249).
"""

from __future__ import annotations

import gc
import threading


class CollectorPause:
    """A process-wide count of holders; the collector is disabled while it is above zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @property
    def holders(self) -> int:
        """How many holds are active."""
        return self._holders

    def hold(self) -> None:
        """Pause the collector (the first hold remembers whether it was enabled)."""
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1

    def release(self) -> None:
        """Give one hold back; the last one re-enables the collector if it was enabled.

        Raises:
            RuntimeError: Nothing is held.
        """
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("the collector pause is not held")
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()


COLLECTOR_PAUSE = CollectorPause()
"""The one pause of this process, shared by every control plane in it."""
