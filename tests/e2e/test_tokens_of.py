"""Rebuilding token sequences from manifests: the chain walk refuses what does not add up."""

from __future__ import annotations

import pytest

from e2e._drill.tokens_of import TokenSequenceError, call_chain


def _record(call: str, parent: str | None, prev: int, cum: int) -> dict[str, object]:
    return {"model_call_id": call, "parent_call_id": parent, "prev_len": prev, "cum_len": cum}


def test_the_chain_runs_from_the_root_to_the_longest_call() -> None:
    records = [_record("c1", None, 0, 10), _record("c2", "c1", 10, 25), _record("c3", "c2", 25, 40)]
    assert [r["model_call_id"] for r in call_chain(records)] == ["c1", "c2", "c3"]


def test_a_sibling_that_is_not_the_leaf_is_left_out() -> None:
    records = [
        _record("c1", None, 0, 10),
        _record("dead", "c1", 10, 20),
        _record("c2", "c1", 10, 30),
    ]
    assert [r["model_call_id"] for r in call_chain(records)] == ["c1", "c2"]


@pytest.mark.parametrize(
    "records",
    [
        [_record("c2", "missing", 10, 20)],
        [_record("c1", None, 0, 10), _record("c2", "c1", 12, 20)],
    ],
)
def test_a_broken_chain_is_an_error(records: list[dict[str, object]]) -> None:
    with pytest.raises(TokenSequenceError):
        call_chain(records)
