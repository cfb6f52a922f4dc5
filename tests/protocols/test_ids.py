"""Identity rules: rollout ids, capture keys, attempts, covers, checkpoint ids."""

from __future__ import annotations

import copy
import itertools
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

import protocols._ids as ids
from protocols import (
    EpisodeId,
    InvalidRolloutIdError,
    attempts_through,
    capture_key,
    keys_covered_by,
    sorted_capture_keys,
    validate_checkpoint_id,
    validate_ledger_key,
    validate_rollout_ids,
)
from protocols._ids import (
    MAX_ATTEMPT,
    MAX_ROLLOUT_ID_LENGTH,
    ROLLOUT_ID_PATTERN,
    RolloutId,
    validate_rollout_id,
)
from protocols._ledger_keys import MAX_LEDGER_KEY_LENGTH

VALID = ["a", "Z9", "rollout-1", "r.x_y-z", "x-a0", "x-a01", "x-ab1", "a-a", "7"]
INVALID = ["", "-a", ".a", "_a", "a b", "a/b", "é", "a-a1", "run-a12", "x\n", "a:b", "a-a9"]


@pytest.mark.parametrize("rollout_id", VALID)
def test_valid_rollout_ids_pass(rollout_id: str) -> None:
    assert validate_rollout_id(rollout_id) == rollout_id
    assert EpisodeId(rollout_id=rollout_id).rollout_id == rollout_id


@pytest.mark.parametrize("rollout_id", INVALID)
def test_invalid_rollout_ids_fail(rollout_id: str) -> None:
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(rollout_id)
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id=rollout_id)


def test_the_attempt_suffix_is_reserved() -> None:
    with pytest.raises(InvalidRolloutIdError, match="reserved"):
        validate_rollout_id("rollout-a3")


def test_a_non_string_rollout_id_fails() -> None:
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(12)


def _follows_the_rule(rollout_id: object) -> bool:
    try:
        validate_rollout_id(rollout_id)
    except InvalidRolloutIdError:
        return False
    return True


def test_the_wire_pattern_is_the_rule_for_every_short_id_of_a_telling_alphabet() -> None:
    # 'a' and '-' make the suffix, '0' and '1' decide whether digits after it are one, 'A' is
    # every other letter, '.' and '_' the other punctuation, ' ' anything refused (D436).
    pattern = re.compile(ROLLOUT_ID_PATTERN)
    for length in range(1, 7):
        for letters in itertools.product("aA01-._ ", repeat=length):
            rollout_id = "".join(letters)
            assert bool(pattern.search(rollout_id)) == _follows_the_rule(rollout_id), rollout_id


WIRE_ROLLOUT_ID: TypeAdapter[str] = TypeAdapter(RolloutId)


def _accepted_on_the_wire(rollout_id: object) -> bool:
    try:
        WIRE_ROLLOUT_ID.validate_python(rollout_id)
    except ValidationError:
        return False
    return True


@given(
    st.text(alphabet=st.sampled_from("aAb019-._/é\n"), max_size=12)
    | st.text(max_size=8)
    | st.integers()
    | st.sampled_from(["r" * MAX_ROLLOUT_ID_LENGTH, "r" * (MAX_ROLLOUT_ID_LENGTH + 1)])
)
def test_a_wire_model_accepts_exactly_the_ids_the_rule_accepts(rollout_id: object) -> None:
    assert _accepted_on_the_wire(rollout_id) == _follows_the_rule(rollout_id)


def test_a_wire_model_checks_rollout_ids_without_calling_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(rollout_id: object) -> str:
        raise AssertionError("a wire model called the Python rule")

    monkeypatch.setattr(ids, "validate_rollout_id", refuse)
    assert EpisodeId.model_validate_json('{"rollout_id": "r-a0", "attempt": 2}').attempt == 2


def test_a_refused_wire_rollout_id_names_the_whole_rule() -> None:
    for bad in ("run-a3", "x" * (MAX_ROLLOUT_ID_LENGTH + 1), "a b", 7):
        with pytest.raises(ValidationError) as caught:
            EpisodeId.model_validate({"rollout_id": bad})
        (error,) = caught.value.errors()
        assert error["type"] == "invalid_rollout_id"
        assert error["loc"] == ("rollout_id",)
        assert "reserved for capture keys" in error["msg"]
        assert f"within {MAX_ROLLOUT_ID_LENGTH} characters" in error["msg"]


def test_a_bare_string_is_not_a_batch() -> None:
    with pytest.raises(TypeError, match="sequence of rollout ids"):
        validate_rollout_ids("abc")


def test_a_batch_is_validated_whole_and_deduplicated_in_order() -> None:
    assert validate_rollout_ids(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_ids(["a", "b", "bad id"])


def test_capture_keys() -> None:
    assert EpisodeId(rollout_id="r").capture_key == "r"
    assert EpisodeId(rollout_id="r", attempt=1).capture_key == "r-a1"
    assert capture_key("r", 12) == "r-a12"
    assert EpisodeId.from_capture_key("r-a12") == EpisodeId(rollout_id="r", attempt=12)
    assert EpisodeId.from_capture_key("r") == EpisodeId(rollout_id="r", attempt=0)
    # "-a0" and leading zeros are not attempt suffixes, so such keys are attempt 0 of themselves.
    assert EpisodeId.from_capture_key("r-a0") == EpisodeId(rollout_id="r-a0", attempt=0)
    assert EpisodeId.from_capture_key("r-a01") == EpisodeId(rollout_id="r-a01", attempt=0)


@pytest.mark.parametrize("key", ["", "a b", "-a1", "x-a1-a2", "r-a1/../x"])
def test_malformed_capture_keys_fail(key: str) -> None:
    with pytest.raises(InvalidRolloutIdError):
        EpisodeId.from_capture_key(key)


rollout_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,30}\Z").filter(
    lambda s: not __import__("re").search(r"-a[1-9][0-9]*$", s)
)


@given(rollout_ids, st.integers(min_value=0, max_value=MAX_ATTEMPT))
def test_capture_key_round_trips(rollout_id: str, attempt: int) -> None:
    episode = EpisodeId(rollout_id=rollout_id, attempt=attempt)
    assert EpisodeId.from_capture_key(episode.capture_key) == episode


def test_attempts_are_non_negative() -> None:
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id="r", attempt=-1)


def test_ids_and_attempts_are_bounded_so_every_capture_key_is_a_legal_file_name() -> None:
    longest = "r" * MAX_ROLLOUT_ID_LENGTH
    assert validate_rollout_id(longest) == longest
    with pytest.raises(InvalidRolloutIdError, match="longer than"):
        validate_rollout_id(longest + "r")
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id=longest + "r")
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id="r", attempt=MAX_ATTEMPT + 1)
    key = EpisodeId(rollout_id=longest, attempt=MAX_ATTEMPT).capture_key
    assert len(key) <= MAX_LEDGER_KEY_LENGTH
    assert validate_ledger_key(key) == key
    with pytest.raises(InvalidRolloutIdError, match="longer than"):
        validate_ledger_key("k" * (MAX_LEDGER_KEY_LENGTH + 1))
    # A capture key too long, or with an attempt too high, is refused as a key, not a 500.
    for bad in (longest + "r", f"r-a{MAX_ATTEMPT + 1}", "r-a" + "9" * 5000):
        with pytest.raises(InvalidRolloutIdError):
            EpisodeId.from_capture_key(bad)


def test_episode_ids_are_frozen_and_strict() -> None:
    episode = EpisodeId(rollout_id="r", attempt=2)
    with pytest.raises(ValidationError):
        episode.attempt = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        EpisodeId.model_validate({"rollout_id": "r", "attempt": 0, "extra": 1})


def test_next_attempt_and_covers() -> None:
    episode = EpisodeId(rollout_id="r", attempt=2)
    assert episode.next_attempt() == EpisodeId(rollout_id="r", attempt=3)
    assert episode.covers(EpisodeId(rollout_id="r", attempt=0))
    assert episode.covers(EpisodeId(rollout_id="r", attempt=2))
    assert not episode.covers(EpisodeId(rollout_id="r", attempt=3))
    assert not episode.covers(EpisodeId(rollout_id="r2", attempt=0))


@given(rollout_ids, st.integers(min_value=0, max_value=MAX_ATTEMPT - 1))
def test_a_next_attempt_is_the_episode_validation_would_build(
    rollout_id: str, attempt: int
) -> None:
    """D377, D391: built without validating again, yet equal in every way a caller can see."""
    built = EpisodeId(rollout_id=rollout_id, attempt=attempt).next_attempt()
    validated = EpisodeId(rollout_id=rollout_id, attempt=attempt + 1)
    assert type(built) is EpisodeId
    assert built == validated and hash(built) == hash(validated) and validated == built
    assert repr(built) == repr(validated)
    assert built.model_dump_json() == validated.model_dump_json()
    assert pickle.loads(pickle.dumps(built)) == validated  # noqa: S301  # its own bytes
    assert copy.deepcopy(built) == validated and built.model_copy() == validated
    assert (built.__pydantic_extra__, built.__pydantic_private__) == (
        validated.__pydantic_extra__,
        validated.__pydantic_private__,
    )
    assert built.model_fields_set == validated.model_fields_set == {"rollout_id", "attempt"}
    assert built.capture_key == validated.capture_key
    with pytest.raises(ValidationError):
        built.attempt = 0  # type: ignore[misc]  # frozen, as a validated one is


def test_the_last_attempt_has_no_next_one() -> None:
    with pytest.raises(ValidationError):
        EpisodeId(rollout_id="r", attempt=MAX_ATTEMPT).next_attempt()


def test_scopes_compare_as_sorted_keys() -> None:
    a = [EpisodeId(rollout_id="b"), EpisodeId(rollout_id="a", attempt=1), EpisodeId(rollout_id="b")]
    assert sorted_capture_keys(a) == ["a-a1", "b"]


def test_checkpoint_ids() -> None:
    assert validate_checkpoint_id("c" * 128) == "c" * 128
    for bad in ["", "c" * 129, "../x", ".hidden", "a/b"]:
        with pytest.raises(ValueError, match="checkpoint id"):
            validate_checkpoint_id(bad)


# Rollout ids that are prefixes or look-alikes of each other's capture keys ("r-a1" is attempt 1
# of "r"; "r-a0", "r-ab" and "r-a01" are rollouts of their own), and any id at all.
look_alikes = st.sampled_from(["r", "r-a0", "r-ab", "r-a01", "r-a1x", "r.a1", "ra1", "x"])
some_episodes = st.lists(
    st.builds(
        EpisodeId,
        rollout_id=st.one_of(look_alikes, rollout_ids),
        attempt=st.integers(min_value=0, max_value=12),
    ),
    max_size=12,
)


@given(tracked=some_episodes, retired=some_episodes)
def test_keys_covered_by_is_covers_over_every_pair(
    tracked: list[EpisodeId], retired: list[EpisodeId]
) -> None:
    keys = [episode.capture_key for episode in tracked]
    expected = [
        key for key in keys if any(r.covers(EpisodeId.from_capture_key(key)) for r in retired)
    ]
    assert keys_covered_by(keys, retired) == expected
    through = attempts_through(retired)
    assert [e for e in tracked if e.attempt <= through.get(e.rollout_id, -1)] == [
        e for e in tracked if any(r.covers(e) for r in retired)
    ]


def test_keys_covered_by_tells_look_alikes_apart() -> None:
    keys = ["r", "r-a1", "r-a2", "r-a3", "r-a0", "r-a01", "r-ab", "r-a1x", "s-a1"]
    retired = [EpisodeId(rollout_id="r", attempt=2), EpisodeId(rollout_id="r", attempt=1)]
    assert keys_covered_by(keys, retired) == ["r", "r-a1", "r-a2"]
    assert keys_covered_by(keys, [EpisodeId(rollout_id="r-a0", attempt=0)]) == ["r-a0"]
    assert keys_covered_by(keys, []) == []
