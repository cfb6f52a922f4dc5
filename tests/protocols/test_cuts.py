"""Generation-cut wire models: inventory digest, ack rules, receipt checks, continuation."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from protocols import (
    VERIFIED_INVENTORY,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
    GenerationCutRecord,
    inventory_digest,
)
from protocols._cuts import GenerationCutContinuation, same_prefixes

DIGEST = "ef" * 32


def _prefix(ticket: str, call: str = "c1", **changes: Any) -> GenerationCutPrefix:
    fields: dict[str, Any] = {
        "ticket_id": ticket,
        "rollout_id": "r1",
        "attempt": 1,
        "model_call_id": call,
        "admitted_at": 1700000000.25,
    }
    fields.update(changes)
    return GenerationCutPrefix(**fields)


def _inventory() -> GenerationCutInventory:
    return GenerationCutInventory.build(
        checkpoint_id="ckpt-1",
        server_name="policy",
        active_prefixes=[_prefix("t2", "c2"), _prefix("t1", "c1")],
    )


def test_the_inventory_digest_is_canonical_json_sorted_by_ticket() -> None:
    inventory = _inventory()
    assert [p.ticket_id for p in inventory.active_prefixes] == ["t1", "t2"]
    canonical = json.dumps(
        {
            "checkpoint_id": "ckpt-1",
            "server_name": "policy",
            "active_prefixes": [
                {
                    "ticket_id": t,
                    "rollout_id": "r1",
                    "attempt": 1,
                    "model_call_id": c,
                    "admitted_at": 1700000000.25,
                }
                for t, c in (("t1", "c1"), ("t2", "c2"))
            ],
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    assert '"admitted_at":1700000000.25' in canonical
    assert inventory.inventory_digest == hashlib.sha256(canonical.encode()).hexdigest()
    assert inventory.inventory_digest == (
        "3df463b3896dcff3af2d1658dce787c90709ef7bf7cc44c8d9c8f07c877d00b2"
    )
    assert inventory_digest("ckpt-1", "policy", reversed(inventory.active_prefixes)) == (
        inventory.inventory_digest
    )
    assert GenerationCutInventory.model_validate_json(inventory.model_dump_json()) == inventory


def test_a_prefixs_fields_are_its_dump_in_both_modes() -> None:
    # inventory_digest, the acks and failure read them; a field added to the model must be here.
    for prefix in _inventory().active_prefixes:
        assert prefix.fields() == prefix.model_dump() == prefix.model_dump(mode="json")
        assert list(prefix.fields()) == list(GenerationCutPrefix.model_fields)


def test_an_inventory_with_a_wrong_digest_or_order_is_refused() -> None:
    data = _inventory().model_dump()
    with pytest.raises(ValidationError, match="inventory_digest"):
        GenerationCutInventory.model_validate({**data, "server_name": "other"})
    with pytest.raises(ValidationError, match="sorted"):
        GenerationCutInventory.model_validate(
            {**data, "active_prefixes": list(reversed(data["active_prefixes"]))}
        )
    with pytest.raises(ValidationError, match="unique"):
        GenerationCutInventory.build(
            checkpoint_id="ckpt-1", server_name="p", active_prefixes=[_prefix("t1"), _prefix("t1")]
        )


def test_prefixes_use_the_rollout_id_rule_and_exact_floats() -> None:
    with pytest.raises(ValidationError):
        _prefix("t1", rollout_id="r1-a2")
    with pytest.raises(ValidationError):
        _prefix("t1", admitted_at=1700000000)
    assert _prefix("t1").capture_key == "r1-a1"


def _durable(prefix: GenerationCutPrefix, **changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        **prefix.model_dump(),
        "disposition": "durable_prefix",
        "cut_kind": "active_prefix",
        "frozen_buffer_id": "active/ckpt-1/1",
        "staging_keys": ["__generation_cut__/c1/1"],
        "prefix_token_count": 4,
        "prefix_digest": DIGEST,
        "effective_output_limit": 32,
    }
    fields.update(changes)
    return fields


def test_ack_rules() -> None:
    prefix = _prefix("t1")
    ack = GenerationCutPrefixAck.model_validate(_durable(prefix))
    assert ack.identity() == prefix.identity()
    terminal = GenerationCutPrefixAck.model_validate(
        _durable(prefix, cut_kind="terminal_completion", terminal_finish_reason="length")
    )
    assert terminal.terminal_finish_reason == "length"
    failed = GenerationCutPrefixAck.failure(prefix, terminal_finish_reason="stop")
    assert failed.disposition == "durable_failure" and failed.staging_keys is None


@pytest.mark.parametrize(
    "changes",
    [
        {"cut_kind": None},
        {"frozen_buffer_id": None},
        {"staging_keys": []},
        {"staging_keys": ["k", "k"]},
        {"prefix_token_count": None},
        {"prefix_token_count": -1},
        {"prefix_digest": "x"},
        {"effective_output_limit": 0},
        {"cut_kind": "terminal_completion"},
        {"terminal_finish_reason": "length"},
        {"terminal_finish_reason": "eos", "cut_kind": "terminal_completion"},
        {"terminal_stop_reason": 7},
        {"disposition": "durable_failure"},
        {"extra": 1},
    ],
)
def test_ack_refusals(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        GenerationCutPrefixAck.model_validate(_durable(_prefix("t1"), **changes))


@pytest.mark.parametrize(
    "evidence",
    [
        {"cut_kind": "active_prefix"},
        {"frozen_buffer_id": "b"},
        {"staging_keys": ["k"]},
        {"prefix_token_count": 1},
        {"prefix_digest": DIGEST},
        {"effective_output_limit": 3},
    ],
)
def test_a_durable_failure_carries_no_prefix_evidence(evidence: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="no prefix evidence"):
        GenerationCutPrefixAck.model_validate(
            {**_prefix("t1").model_dump(), "disposition": "durable_failure", **evidence}
        )


def _receipt(
    inventory: GenerationCutInventory, acks: list[GenerationCutPrefixAck]
) -> GenerationCutReceipt:
    return GenerationCutReceipt(
        checkpoint_id=inventory.checkpoint_id,
        cut_id="cut-1",
        inventory_digest=inventory.inventory_digest,
        inventory=inventory,
        backend_snapshot_id="worker/cut-1",
        prefixes=acks,
    )


def test_a_receipt_answers_its_inventory_exactly() -> None:
    inventory = _inventory()
    acks = [GenerationCutPrefixAck.failure(p) for p in inventory.active_prefixes]
    receipt = _receipt(inventory, acks)
    receipt.validate_for(inventory)
    assert GenerationCutReceipt.model_validate_json(receipt.model_dump_json()) == receipt
    with pytest.raises(ValueError, match="every ticket"):
        _receipt(inventory, acks[:1]).validate_for(inventory)
    other_call = GenerationCutPrefixAck.failure(_prefix("t2", "c9"))
    with pytest.raises(ValueError, match="another call"):
        _receipt(inventory, [acks[0], other_call]).validate_for(inventory)
    other = GenerationCutInventory.build(
        checkpoint_id="ckpt-1", server_name="x", active_prefixes=[]
    )
    with pytest.raises(ValueError, match="another inventory"):
        receipt.validate_for(other)


def test_a_receipt_must_embed_its_own_inventory() -> None:
    inventory = _inventory()
    data = _receipt(inventory, []).model_dump()
    with pytest.raises(ValidationError, match="digests"):
        GenerationCutReceipt.model_validate({**data, "inventory_digest": DIGEST})
    with pytest.raises(ValidationError, match="checkpoints"):
        GenerationCutReceipt.model_validate({**data, "checkpoint_id": "ckpt-2"})
    acks = [GenerationCutPrefixAck.failure(inventory.active_prefixes[0])] * 2
    with pytest.raises(ValidationError, match="unique"):
        _receipt(inventory, acks)


def test_the_continuation_of_an_ack() -> None:
    ack = GenerationCutPrefixAck.model_validate(_durable(_prefix("t1")))
    continuation = ack.continuation()
    assert continuation.source_capture_key == "r1-a1"
    assert continuation.source_model_call_id == "c1"
    assert continuation.staging_keys == ["__generation_cut__/c1/1"]
    assert continuation.prefix_token_count == 4 and continuation.schema_version == 2
    with pytest.raises(ValueError, match="durable_prefix"):
        GenerationCutPrefixAck.failure(_prefix("t1")).continuation()
    record = GenerationCutRecord(
        model_call_id="c1", request_digest=DIGEST, continuation=continuation
    )
    assert GenerationCutRecord.model_validate_json(record.model_dump_json()) == record


@pytest.mark.parametrize(
    "changes",
    [
        {"staging_keys": []},
        {"staging_keys": ["a", "a"]},
        {"effective_output_limit": 0},
        {"prefix_token_count": -1},
        {"terminal_stop_reason": "eos"},
        {"schema_version": 1},
    ],
)
def test_continuation_refusals(changes: dict[str, Any]) -> None:
    fields = {
        "source_capture_key": "r1",
        "source_model_call_id": "c1",
        "staging_keys": ["k"],
        "prefix_token_count": 1,
        "prefix_digest": DIGEST,
        "effective_output_limit": 8,
        **changes,
    }
    with pytest.raises(ValidationError):
        GenerationCutContinuation.model_validate(fields)


def _receipt_json(inventory: GenerationCutInventory, **embedded: Any) -> str:
    body = {
        "checkpoint_id": inventory.checkpoint_id,
        "cut_id": "cut-1",
        "inventory_digest": inventory.inventory_digest,
        "inventory": inventory.model_dump(mode="json") | embedded,
        "backend_snapshot_id": "worker/cut-1",
        "prefixes": [
            GenerationCutPrefixAck.failure(p).model_dump(mode="json")
            for p in inventory.active_prefixes
        ],
    }
    return json.dumps(body)


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the inventory digest is computed."""
    import protocols._cuts as cuts

    counted = [0]
    real = cuts.inventory_digest

    def counting(*args: Any) -> str:
        counted[0] += 1
        return real(*args)

    monkeypatch.setattr(cuts, "inventory_digest", counting)
    return counted


def test_a_cut_round_digests_its_inventory_once_when_built_and_once_when_parsed(
    digests: list[int],
) -> None:
    inventory = _inventory()
    assert digests[0] == 1  # build: computed, not checked again
    parsed = GenerationCutInventory.model_validate_json(inventory.model_dump_json())
    assert digests[0] == 2  # the worker's parse of an untrusted body: checked
    receipt = GenerationCutReceipt.model_validate_json(
        _receipt_json(parsed), context={VERIFIED_INVENTORY: inventory}
    )
    receipt.validate_for(inventory)
    assert digests[0] == 2  # the receipt embeds an inventory equal to the verified one
    GenerationCutReceipt.model_validate_json(_receipt_json(parsed))
    assert digests[0] == 3  # without the context it is checked, as before


def test_a_verified_inventory_in_the_context_never_excuses_a_different_embedded_one() -> None:
    inventory = _inventory()
    forged = _receipt_json(inventory, server_name="other")  # its digest no longer matches
    with pytest.raises(ValidationError, match="inventory_digest does not match"):
        GenerationCutReceipt.model_validate_json(forged, context={VERIFIED_INVENTORY: inventory})
    reordered = _receipt_json(
        inventory,
        active_prefixes=[p.model_dump(mode="json") for p in inventory.active_prefixes[::-1]],
    )
    with pytest.raises(ValidationError, match="sorted by ticket_id"):
        GenerationCutReceipt.model_validate_json(reordered, context={VERIFIED_INVENTORY: inventory})


def test_build_still_refuses_duplicate_tickets_without_digesting_twice() -> None:
    with pytest.raises(ValidationError, match="ticket ids must be unique"):
        GenerationCutInventory.build(
            checkpoint_id="ckpt-1",
            server_name="policy",
            active_prefixes=[_prefix("t1", "c1"), _prefix("t1", "c2")],
        )


class _LookAlikePrefix(GenerationCutPrefix):
    """A prefix of another type with the same fields: never equal to a plain one."""


@given(
    st.lists(st.sampled_from(["t1", "t2", "t3"]), max_size=3, unique=True),
    st.sampled_from([None, "ticket_id", "rollout_id", "attempt", "admitted_at", "type", "drop"]),
)
def test_same_prefixes_answers_what_equality_answers(
    tickets: list[str], change: str | None
) -> None:
    first = [_prefix(t, f"c{t}") for t in tickets]
    second = list(first)
    if second and change == "type":
        second[-1] = _LookAlikePrefix(**second[-1].fields())
    elif second and change == "drop":
        second.pop()
    elif second and change is not None:
        replaced = {"ticket_id": "t9", "rollout_id": "r9", "attempt": 7, "admitted_at": 1.5}
        second[0] = GenerationCutPrefix(**{**second[0].fields(), change: replaced[change]})
    assert same_prefixes(first, second) == (first == second)
    assert same_prefixes(second, first) == (second == first)


def test_a_receipt_embedding_another_inventory_under_our_digest_answers_another_inventory() -> None:
    # The worker's copy differs in one call's admission time and still claims our digest: only a
    # comparison of every prefix tells them apart (D437).
    inventory = _inventory()
    prefixes = list(inventory.active_prefixes)
    prefixes[1] = _prefix("t2", "c2", admitted_at=1700000000.5)
    theirs = GenerationCutInventory.model_construct(
        **{**dict(inventory), "active_prefixes": prefixes}
    )
    acks = [GenerationCutPrefixAck.failure(p) for p in prefixes]
    receipt = GenerationCutReceipt.model_construct(
        **{**dict(_receipt(inventory, [])), "inventory": theirs, "prefixes": acks}
    )
    with pytest.raises(ValueError, match="another inventory"):
        receipt.validate_for(inventory)


def test_a_receipt_may_ack_in_any_order_but_every_ack_must_name_its_call() -> None:
    inventory = _inventory()
    acks = [GenerationCutPrefixAck.failure(p) for p in inventory.active_prefixes]
    _receipt(inventory, acks[::-1]).validate_for(inventory)
    late = GenerationCutPrefixAck.failure(_prefix("t2", "c2", admitted_at=1700000000.5))
    with pytest.raises(ValueError, match="ack of ticket 't2' names another call"):
        _receipt(inventory, [late, acks[0]]).validate_for(inventory)
