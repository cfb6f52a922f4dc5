"""What one span call costs: ``checkpoint_span`` with no provider, beside empty context managers.

The claim "tracing off costs nothing" rests on these figures: with no SDK installed, a span call
is a check and an empty context manager.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from participants import checkpoint_span


def per_loop_ns(body: Callable[[], None], loops: int) -> float:
    """Median over three timings of ``loops`` calls of ``body``: ns per call."""
    timings = []
    for _ in range(3):
        start = time.perf_counter_ns()
        for _ in range(loops):
            body()
        timings.append((time.perf_counter_ns() - start) / loops)
    return round(sorted(timings)[1], 1)


def span_costs(
    tracing_on: Callable[[], AbstractContextManager[None]], loops: int
) -> dict[str, Any]:
    """ns per ``checkpoint_span`` with no provider, per empty ``nullcontext``, per empty
    ``@contextmanager`` (the shape ``checkpoint_span`` has), and per span with the provider on."""

    def empty() -> None:
        with nullcontext():
            pass

    @contextmanager
    def bare() -> Iterator[None]:
        yield

    def shape() -> None:
        with bare():
            pass

    def span() -> None:
        with checkpoint_span("midflight.bench.span", id="bench-micro"):
            pass

    off = per_loop_ns(span, loops)
    floor = per_loop_ns(empty, loops)
    generator = per_loop_ns(shape, loops)
    with tracing_on():
        on = per_loop_ns(span, max(loops // 20, 1))
    return {
        "span_off_ns": off,
        "nullcontext_ns": floor,
        "span_off_extra_ns": round(off - floor, 1),
        "empty_contextmanager_ns": generator,
        "span_on_ns": on,
        "loops": loops,
    }
