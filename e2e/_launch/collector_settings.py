"""The cyclic garbage collector's thresholds in a server process, set from the environment (D428).

Python's defaults (``700, 10, 10``) stay unless ``MIDFLIGHT_GC_THRESHOLDS`` names others, as
``gc.set_threshold`` takes them: one to three whole numbers, comma-separated. Every process
``midflight serve`` starts reads it, shard processes included (they inherit the environment).
At thousands of calls in flight the collector's full collections walk every call's objects, and
``bench hotpath --in-flight`` shows what they cost a call (D427); ``docs/operations.md`` says when
a larger third threshold is worth it.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from typing import Final

GC_THRESHOLDS_ENV: Final = "MIDFLIGHT_GC_THRESHOLDS"
"""``threshold0[,threshold1[,threshold2]]``, as ``gc.set_threshold`` takes them."""


def parse_collector_thresholds(value: str) -> tuple[int, ...]:
    """The thresholds a ``MIDFLIGHT_GC_THRESHOLDS`` value names.

    Raises:
        ValueError: Not one to three comma-separated whole numbers of at least 0.
    """
    parts = [part.strip() for part in value.split(",")]
    if not 1 <= len(parts) <= 3 or not all(part.isdigit() and part.isascii() for part in parts):
        raise ValueError(
            f"{GC_THRESHOLDS_ENV}={value!r}: give one to three whole numbers, comma-separated, "
            "as gc.set_threshold takes them (Python's defaults are 700,10,10)"
        )
    return tuple(int(part) for part in parts)


def apply_collector_thresholds(
    environ: Mapping[str, str] | None = None,
) -> tuple[int, int, int] | None:
    """Set the collector's thresholds from ``MIDFLIGHT_GC_THRESHOLDS``, if it names any.

    Returns:
        The thresholds now in force, or ``None`` when the variable is unset or empty (nothing
        changed).

    Raises:
        ValueError: The value is malformed; nothing changed.
    """
    value = (os.environ if environ is None else environ).get(GC_THRESHOLDS_ENV, "")
    if not value.strip():
        return None
    gc.set_threshold(*parse_collector_thresholds(value))
    return gc.get_threshold()
