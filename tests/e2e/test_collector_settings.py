"""``MIDFLIGHT_GC_THRESHOLDS``: parsed strictly, applied only when set (D428)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from e2e._launch.collector_settings import (
    GC_THRESHOLDS_ENV,
    apply_collector_thresholds,
    parse_collector_thresholds,
)


@pytest.fixture(autouse=True)
def _thresholds_restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.parametrize(
    ("value", "thresholds"),
    [("700,10,100", (700, 10, 100)), (" 5000 ", (5000,)), ("0, 10", (0, 10))],
)
def test_one_to_three_whole_numbers_are_thresholds(value: str, thresholds: tuple[int, ...]) -> None:
    assert parse_collector_thresholds(value) == thresholds


@pytest.mark.parametrize(
    "value", ["1,2,3,4", "700;10", "-1", "1.5", "x", "700,,10", "\u0661\u0662"]
)
def test_anything_else_is_refused_and_changes_nothing(value: str) -> None:
    before = gc.get_threshold()
    with pytest.raises(ValueError, match=GC_THRESHOLDS_ENV):
        apply_collector_thresholds({GC_THRESHOLDS_ENV: value})
    assert gc.get_threshold() == before


def test_set_the_thresholds_are_in_force_and_unset_nothing_changes() -> None:
    gc.set_threshold(700, 10, 10)
    assert apply_collector_thresholds({}) is None
    assert apply_collector_thresholds({GC_THRESHOLDS_ENV: "  "}) is None
    assert gc.get_threshold() == (700, 10, 10)
    assert apply_collector_thresholds({GC_THRESHOLDS_ENV: "700,10,100"}) == (700, 10, 100)
    assert gc.get_threshold() == (700, 10, 100)
    assert apply_collector_thresholds({GC_THRESHOLDS_ENV: "900"}) == (900, 10, 100)
