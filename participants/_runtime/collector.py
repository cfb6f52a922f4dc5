"""Pausing Python's cyclic garbage collector while a checkpoint or a restore holds its batch.

With thousands of rollouts in flight a server holds millions of tracked objects, and one full
(generation 2) collection walks all of them. The collector runs a full collection each time the
objects that survived grow by a quarter, so a batch that grows the heap pays for a chain of full
traversals, each of the whole heap. Measured on the development VM: one full collection of 2.05 s
inside a checkpoint with 4,000 rollouts parked, set off by the cut round's own allocations
(D249); 9 full collections and about 2.7 s of a 5.2 s restore of 16,000 rollouts, 4 and 0.6 to
0.8 s at 4,000 — the collector made restore grow faster than linearly (D266).

Reference counting goes on; only the cycle collector waits. When the last hold ends, what
survived the pause goes straight to the oldest generation, examined by the next full collection
(D347). There is one count per process: a control plane holds it while it is outside ``IDLE``
(:class:`CollectorPause`, held by ``ControlPlane.transition``), a restore's read and install hold
it for their block (:func:`collector_paused`). Holds nest and overlap across threads and planes
(five in-process servers in the benchmarks); the last one out re-enables the collector only if it
was enabled when the first one came in, so a process that turned it off on purpose keeps it off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


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
                promote_survivors()
                gc.enable()


def promote_survivors() -> None:
    """Move every tracked object into the oldest generation without examining any (D347).

    While the collector is off, every container a batch allocates stays young; the first young
    collection after the pause would examine all of them at once (about 0.18 s after a checkpoint
    of 16,000 rollouts, inside its resume). ``gc.freeze()`` then ``gc.unfreeze()`` moves them to
    the oldest generation in constant time, where the next full collection examines them, and
    finds any cycle among them, as it would have anyway. Skipped when the process has frozen
    objects of its own: ``unfreeze`` would thaw them too.
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


COLLECTOR_PAUSE = CollectorPause()
"""The one pause of this process, shared by every control plane and restore in it."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Keep the cyclic garbage collector off while the block runs, even when it raises."""
    COLLECTOR_PAUSE.hold()
    try:
        yield
    finally:
        COLLECTOR_PAUSE.release()


def pauses_active() -> int:
    """How many holds are in force now (tests and diagnostics)."""
    return COLLECTOR_PAUSE.holders
