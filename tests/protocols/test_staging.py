"""Staged call records, admissions and commit coordinates: rules, strictness, integrity."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

import protocols._staging as staging_module
from protocols import (
    CaptureAdmission,
    CommitCoords,
    StagedCallRecord,
    StagedEntry,
    compute_chain_hash,
    generation_cut_staging_key,
    hash_token_ids,
    staging_key,
)
from tests.staging_factories import golden_record

identifiers = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_/", min_size=1, max_size=12)
floats32 = st.floats(min_value=-30.0, max_value=-0.5, width=32)


@st.composite
def staged_records(draw: st.DrawFn) -> StagedCallRecord:
    """Random valid records: roots and children, prompt carry and generated tokens, extras."""
    is_root = draw(st.booleans())
    carried = draw(st.lists(st.integers(0, 2**64 - 1), max_size=6))
    generated = draw(st.lists(st.integers(0, 255), max_size=6))
    if not carried and not generated:
        generated = [draw(st.integers(0, 255))]
    prev_len = 0 if is_root else draw(st.integers(1, 10_000))
    extras = draw(
        st.none()
        | st.dictionaries(identifiers, st.integers(-5, 5) | st.text(max_size=3) | st.booleans())
    )
    tokens = carried + generated
    return StagedCallRecord.from_components(
        rollout_id=draw(identifiers),
        model_call_id=draw(identifiers),
        parent_call_id=None if is_root else draw(identifiers),
        mode="text" if is_root else "token_in",
        prev_len=prev_len,
        weight_version=draw(st.integers(0, 2**64 - 1)),
        token_ids_delta=tokens,
        token_mask_delta=[0.0] * len(carried) + [1.0] * len(generated),
        generation_log_probs_delta=[0.0] * len(carried)
        + draw(st.lists(floats32, min_size=len(generated), max_size=len(generated))),
        chain_hash=compute_chain_hash(None, tokens),
        cumulative_hash=hash_token_ids(tokens),
        extras=extras,
    )


def _flip_hex(value: str) -> str:
    return ("1" if value[0] == "0" else "0") + value[1:]


def _mutations(data: dict[str, Any]) -> dict[str, Any]:
    """One changed value per field, each still of the field's type."""
    masks = list(data["token_mask_delta"])
    log_probs = list(data["generation_log_probs_delta"])
    if masks[0] == 1.0:
        changed_log_probs = [log_probs[0] - 1.0, *log_probs[1:]]
    else:
        changed_log_probs = [-1.0, *log_probs[1:]]
    return {
        "schema_version": 3,
        "digest_version": 1,
        "extras_digest_version": 2,
        "rollout_id": data["rollout_id"] + "x",
        "model_call_id": data["model_call_id"] + "x",
        "parent_call_id": "p" if data["parent_call_id"] is None else data["parent_call_id"] + "x",
        "mode": "token_in" if data["mode"] == "text" else "text",
        "prev_len": data["prev_len"] + 1,
        "delta_len": data["delta_len"] + 1,
        "cum_len": data["cum_len"] + 1,
        "weight_version": (data["weight_version"] + 1) % 2**64,
        "digest": _flip_hex(data["digest"]),
        "token_ids_delta": [(data["token_ids_delta"][0] + 1) % 2**64, *data["token_ids_delta"][1:]],
        "token_mask_delta": [1.0 - masks[0], *masks[1:]],
        "generation_log_probs_delta": changed_log_probs,
        "extras_digest": _flip_hex(data["extras_digest"]),
        "chain_hash": _flip_hex(data["chain_hash"]),
        "cumulative_hash": _flip_hex(data["cumulative_hash"]),
        "extras": {**(data["extras"] or {}), "added": 1},
    }


@given(staged_records())
def test_built_records_validate_from_the_wire(record: StagedCallRecord) -> None:
    assert StagedCallRecord.model_validate_json(record.model_dump_json()) == record
    assert StagedCallRecord.model_validate(record.model_dump()) == record


@given(staged_records(), st.data())
def test_changing_any_single_field_fails_validation(
    record: StagedCallRecord, data: st.DataObject
) -> None:
    dumped = record.model_dump()
    mutations = _mutations(dumped)
    assert set(mutations) == set(StagedCallRecord.model_fields)
    field = data.draw(st.sampled_from(sorted(mutations)))
    with pytest.raises(ValidationError):
        StagedCallRecord.model_validate_json(json.dumps({**dumped, field: mutations[field]}))


def test_every_field_mutation_fails_on_the_golden_record() -> None:
    dumped = golden_record().model_dump()
    for field, value in _mutations(dumped).items():
        with pytest.raises(ValidationError):
            StagedCallRecord.model_validate({**dumped, field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token_mask_delta", [0, 1]),
        ("generation_log_probs_delta", [0, -0.25]),
        ("prev_len", "3"),
        ("prev_len", 3.0),
        ("rollout_id", 5),
        ("unknown", 1),
    ],
)
def test_records_take_no_coercion_and_no_extra_fields(field: str, value: object) -> None:
    dumped = golden_record().model_dump()
    with pytest.raises(ValidationError):
        StagedCallRecord.model_validate_json(json.dumps({**dumped, field: value}))


def test_records_refuse_non_finite_floats_on_the_wire() -> None:
    text = golden_record().model_dump_json().replace("-0.25", "-1e400")
    with pytest.raises(ValidationError):
        StagedCallRecord.model_validate_json(text)


def test_from_components_computes_the_digest_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = staging_module._staging_digest_blocks

    def counting(**fields: Any) -> tuple[str, bytes, bytes, bytes]:
        calls.append(fields["model_call_id"])
        return original(**fields)

    monkeypatch.setattr(staging_module, "_staging_digest_blocks", counting)
    golden_record()
    assert calls == ["call-1"]
    StagedCallRecord.model_validate(golden_record().model_dump())
    assert len(calls) == 3  # one more build, one verification of a record from outside


def test_generated_token_count_counts_mask_one() -> None:
    assert golden_record().generated_token_count == 1


def test_staging_keys() -> None:
    assert staging_key("r1-a2", "call-9") == "r1-a2/call-9"
    assert generation_cut_staging_key("call-9", 2) == "__generation_cut__/call-9/2"
    with pytest.raises(ValueError, match="non-empty"):
        staging_key("", "c")
    with pytest.raises(ValueError, match="sequence"):
        generation_cut_staging_key("c", 0)


def test_a_staged_entry_round_trips_with_attachments() -> None:
    entry = StagedEntry(staging_key="r/c", record=golden_record(), attachments={"note": [1]})
    assert StagedEntry.model_validate_json(entry.model_dump_json()) == entry


# --- CaptureAdmission ------------------------------------------------------------------------

CHAIN = "ab" * 32


def test_admissions_of_a_root_and_a_child() -> None:
    root = CaptureAdmission(rollout_id="r1", model_call_id="c1", mode="text")
    assert root.schema_version == 2 and root.prev_len == 0
    child = CaptureAdmission(
        rollout_id="r1",
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=2,
        mode="token_in",
        required_prefix_token_ids=[1, 2],
        parent_chain_hash=CHAIN,
    )
    assert CaptureAdmission.model_validate_json(child.model_dump_json()) == child
    by_chain = CaptureAdmission(
        rollout_id="r1",
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=2,
        mode="token_in",
        staging_chain=["r1/c1"],
        parent_chain_hash=CHAIN,
    )
    assert by_chain.required_prefix_token_ids == []


@pytest.mark.parametrize(
    "fields",
    [
        {
            "mode": "token_in",
            "prev_len": 2,
            "required_prefix_token_ids": [1, 2],
            "parent_chain_hash": CHAIN,
        },
        {
            "mode": "token_in",
            "parent_call_id": "c1",
            "required_prefix_token_ids": [],
            "parent_chain_hash": CHAIN,
        },
        {
            "mode": "token_in",
            "parent_call_id": "c1",
            "prev_len": 2,
            "required_prefix_token_ids": [1, 2],
        },
        {
            "mode": "token_in",
            "parent_call_id": "c1",
            "prev_len": 2,
            "required_prefix_token_ids": [1],
            "parent_chain_hash": CHAIN,
        },
        {
            "mode": "token_in",
            "parent_call_id": "c1",
            "prev_len": 2,
            "staging_chain": ["k"],
            "required_prefix_token_ids": [1],
            "parent_chain_hash": CHAIN,
        },
        {"mode": "text", "parent_call_id": "c1"},
        {"mode": "text", "prev_len": 1},
        {"mode": "text", "required_prefix_token_ids": [1]},
        {"mode": "text", "staging_chain": ["k"]},
        {"mode": "text", "parent_chain_hash": CHAIN},
        {"mode": "text", "required_prefix_token_ids": [-1]},
        {"mode": "other"},
        {"mode": "text", "rollout_id": ""},
        {"mode": "text", "schema_version": 1},
    ],
)
def test_admissions_enforce_the_prefix_contract(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CaptureAdmission.model_validate({"rollout_id": "r1", "model_call_id": "c", **fields})


# --- CommitCoords ----------------------------------------------------------------------------


def _coords(**changes: Any) -> dict[str, Any]:
    record = golden_record()
    fields: dict[str, Any] = {
        "rollout_id": record.rollout_id,
        "model_call_id": record.model_call_id,
        "parent_call_id": record.parent_call_id,
        "prev_len": record.prev_len,
        "delta_len": record.delta_len,
        "cum_len": record.cum_len,
        "weight_version": record.weight_version,
        "disposition": "staged",
        "digest": record.digest,
        "extras_digest": record.extras_digest,
        "staging_key": "rollout-1/call-1",
        "chain_hash": record.chain_hash,
        "cumulative_hash": record.cumulative_hash,
    }
    fields.update(changes)
    return fields


def test_commit_coords_staged_and_failed() -> None:
    staged = CommitCoords.model_validate(_coords())
    assert staged.digest_version == 2 and staged.extras_digest_version == 1
    failed = CommitCoords.model_validate(
        _coords(
            disposition="capture_failed",
            delta_len=0,
            cum_len=3,
            digest=None,
            extras_digest=None,
            staging_key=None,
            chain_hash=None,
            cumulative_hash=None,
        )
    )
    assert failed.disposition == "capture_failed"


@pytest.mark.parametrize(
    "changes",
    [
        {"digest": None},
        {"staging_key": None},
        {"chain_hash": None},
        {"delta_len": 0, "cum_len": 3},
        {"cum_len": 6},
        {"parent_call_id": None},
        {"prev_len": 0, "cum_len": 2},
        {"disposition": "capture_failed"},
        {
            "disposition": "capture_failed",
            "digest": None,
            "extras_digest": None,
            "staging_key": None,
            "chain_hash": None,
            "cumulative_hash": None,
        },
        {"weight_version": -1},
        {"digest": "X" * 64},
    ],
)
def test_commit_coords_rules(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CommitCoords.model_validate(_coords(**changes))


# -- from_components builds without a second validation pass (D346) ----------------------------


@given(staged_records())
def test_a_built_record_is_the_record_validation_makes_of_its_fields(
    record: StagedCallRecord,
) -> None:
    validated = StagedCallRecord.model_validate(record.model_dump())
    assert record == validated
    assert record.model_fields_set == validated.model_fields_set
    assert record.model_dump_json() == validated.model_dump_json()


@given(staged_records())
def test_a_built_record_is_what_model_construct_makes_of_its_fields(
    record: StagedCallRecord,
) -> None:
    """D417: the builder sets the instance's state itself; pydantic's own builder agrees."""
    constructed = StagedCallRecord.model_construct(**record.model_dump())
    assert vars(record) == vars(constructed)
    assert list(vars(record)) == list(vars(constructed))  # the same field order
    for name in ("__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
        assert getattr(record, name) == getattr(constructed, name)


def test_the_record_model_has_nothing_model_construct_would_add() -> None:
    """The builder skips what model_construct does for aliases, post-init hooks, extra fields
    and private attributes (D417): a change to the model that brings one in fails here."""
    fields = StagedCallRecord.__pydantic_fields__.values()
    assert all(f.alias is None and f.validation_alias is None for f in fields)
    assert StagedCallRecord.__pydantic_post_init__ is None
    assert not StagedCallRecord.__pydantic_root_model__
    assert not StagedCallRecord.__private_attributes__
    assert StagedCallRecord.model_config.get("extra") == "forbid"


class _Text(str):
    pass


@pytest.mark.parametrize(
    "changes",
    [
        {"rollout_id": ""},
        {"rollout_id": 1},
        {"model_call_id": None},
        {"parent_call_id": ""},
        {"parent_call_id": 5},
        {"mode": "chat"},
        {"mode": "text"},
        {"prev_len": -1},
        {"prev_len": True},
        {"prev_len": 3.0},
        {"weight_version": -1},
        {"weight_version": "7"},
        {"token_ids_delta": [10, True]},
        {"token_ids_delta": [10, -1]},
        {"token_ids_delta": [10, 11.0]},
        {"token_mask_delta": [0.0, 1]},
        {"token_mask_delta": [0.0, 0.5]},
        {"generation_log_probs_delta": [0.0, float("nan")]},
        {"generation_log_probs_delta": [0.0, float("inf")]},
        {"generation_log_probs_delta": [0.0, -1]},
        {"chain_hash": "AB" * 32},
        {"chain_hash": "1" * 63},
        {"cumulative_hash": 22},
        {"extras": {1: 2}},
        {"extras": {"x": float("nan")}},
        {"extras": {"x": (1, 2)}},
    ],
    ids=repr,
)
def test_what_validation_refuses_the_builder_refuses_too(changes: dict[str, Any]) -> None:
    """The builder skips pydantic's pass, so every value it would refuse is refused anyway."""
    fields = golden_record().model_dump()
    fields.update(changes)
    with pytest.raises((ValueError, TypeError)):
        StagedCallRecord.model_validate(fields)  # validation refuses it (digest aside) ...
    components = {k: v for k, v in fields.items() if k in _COMPONENTS}
    with pytest.raises((ValueError, TypeError)):
        StagedCallRecord.from_components(**components)  # ... and so does the builder


_COMPONENTS = frozenset(
    {
        "rollout_id", "model_call_id", "parent_call_id", "mode", "prev_len", "weight_version",
        "token_ids_delta", "token_mask_delta", "generation_log_probs_delta", "chain_hash",
        "cumulative_hash", "extras",
    }
)  # fmt: skip


def test_a_text_subclass_id_builds_the_record_validation_makes() -> None:
    built = golden_record(rollout_id=_Text("rollout-1"))
    validated = StagedCallRecord.model_validate(golden_record().model_dump())
    assert built == validated
    assert built.model_dump_json() == validated.model_dump_json()


def test_a_built_record_owns_its_columns_and_extras() -> None:
    tokens, masks, log_probs = [10, 11], [0.0, 1.0], [0.0, -0.25]
    extras: dict[str, Any] = {"note": "a"}
    record = golden_record(
        token_ids_delta=tokens,
        token_mask_delta=masks,
        generation_log_probs_delta=log_probs,
        extras=extras,
    )
    tokens.append(12)
    masks[0] = 1.0
    log_probs[1] = -9.0
    extras["note"] = "changed"
    assert StagedCallRecord.model_validate(record.model_dump()) == record  # digests still hold
    assert record.extras == {"note": "a"}
