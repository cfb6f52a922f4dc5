"""Pausing Python's cyclic garbage collector while a restore builds its batch.

A restore parses, validates and installs every record of a checkpoint in one go, and everything it
allocates stays alive until the batch is done (the parsed records) or for good (the installed
state): there is no cyclic garbage to find. The collector does not know that. It runs a full
collection each time the objects that survived grow by a quarter, and each full collection
traverses every object of the process, so a batch that grows the heap several-fold pays for a
chain of full traversals. Measured at 16,000 rollouts on the development VM: 9 full collections
and about 2.7 s of a 5.2 s restore; at 4,000, 4 full collections and 0.6 to 0.8 s. The number of full
collections grows with the logarithm of the batch and each costs the whole heap, so the collector
made restore grow faster than linearly (``docs/performance.md``, "Restore"; D262).

:func:`collector_paused` disables the collector for the duration of a block and enables it again
afterwards, even when the block raises. Pauses nest and may overlap across threads (four
in-process participants restore at once in the benchmarks): the collector comes back when the
last pause ends, and only if it was enabled when the first one began, so a process that turned
it off on purpose keeps it off. Nothing is skipped: the objects the batch made are examined by the
next collections, once the batch no longer grows them.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_enable_after = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Keep the cyclic garbage collector off while the block runs (reference counting goes on)."""
    global _depth, _enable_after
    with _lock:
        if _depth == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _enable_after:
                gc.enable()


def pauses_active() -> int:
    """How many pauses are in force now (tests and diagnostics)."""
    return _depth
