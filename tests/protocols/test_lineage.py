"""The single lineage matcher, its explicit variant, and the two digests."""

from __future__ import annotations

from typing import Any

import pytest

from protocols import (
    conversation_digest,
    custody_row,
    encode_row,
    failure_row,
    resolve_explicit_rows,
    resolve_rows,
)
from protocols._lineage import FINGERPRINT_VERSION, assistant_fingerprint
from tests.participants.ledger_factory import commit, conversation


def test_the_fingerprint_sees_only_assistant_turns_and_ignores_reasoning() -> None:
    items = conversation(2)
    assert assistant_fingerprint(conversation(0)) == ""
    changed_tool = [dict(i, content="other") if i["role"] == "tool" else i for i in items]
    assert assistant_fingerprint(changed_tool) == assistant_fingerprint(items)
    with_reasoning = [dict(i, reasoning="hmm") if i["role"] == "assistant" else i for i in items]
    assert assistant_fingerprint(with_reasoning) == assistant_fingerprint(items)
    assert conversation_digest(with_reasoning) == conversation_digest(items)
    assert conversation_digest(changed_tool) != conversation_digest(items)
    other_output = [dict(i, content="x") if i["role"] == "assistant" else i for i in items]
    assert assistant_fingerprint(other_output) != assistant_fingerprint(items)


def test_tool_call_arguments_are_canonical() -> None:
    def call(arguments: Any) -> list[dict[str, Any]]:
        return [{"role": "assistant", "tool_calls": [{"name": "add", "arguments": arguments}]}]

    assert assistant_fingerprint(call('{"b": 1, "a": 2}')) == assistant_fingerprint(
        call({"a": 2, "b": 1})
    )
    assert assistant_fingerprint(call('{"a": 1}')) != assistant_fingerprint(call('{"a": 2}'))


def test_resolution_root_resolved_and_no_match() -> None:
    rows = [custody_row(commit("r", 0)), custody_row(commit("r", 1))]
    assert resolve_rows(rows, conversation(0)).status == "root"
    resolved = resolve_rows(rows, conversation(2))
    assert resolved.match is not None and resolved.match.model_call_id == "call-1"
    assert resolved.match.prev_len == 10 and resolved.match.cumulative_token_ids == ()
    rewritten = conversation(2)
    rewritten[1] = {"role": "user", "content": "rewritten"}
    assert resolve_rows(rows, rewritten).reason == "no_match"  # the context digest fails


def test_identical_output_siblings_are_never_guessed() -> None:
    a = custody_row(commit("r", 0, call_id="a"))
    b = custody_row(commit("r", 0, call_id="b"))  # same text, other tokens (other digest)
    assert resolve_rows([a, b], conversation(1)).reason == "ambiguous"
    twin = dict(a, model_call_id="0-twin")  # same tokens: one answer, the smallest id
    resolution = resolve_rows([a, twin], conversation(1))
    assert resolution.match is not None and resolution.match.model_call_id == "0-twin"


def test_failure_rows_and_other_versions_never_resolve() -> None:
    row = custody_row(commit("r", 0))
    assert resolve_rows([failure_row("call-0", "x")], conversation(1)).reason == "no_match"
    old = dict(row, fingerprint_version=FINGERPRINT_VERSION + 1)
    assert resolve_rows([old], conversation(1)).reason == "no_match"


def test_explicit_resolution_reasons() -> None:
    row = custody_row(commit("r", 0))
    assert resolve_explicit_rows([row], "call-0", conversation(1)).status == "resolved"
    assert resolve_explicit_rows([row], "nope", conversation(1)).reason == "explicit_parent_missing"
    mismatch = resolve_explicit_rows([row], "call-0", conversation(2))
    assert mismatch.reason == "explicit_parent_fingerprint_mismatch"
    hollow = dict(row, staging_chain=[])
    missing = resolve_explicit_rows([hollow], "call-0", conversation(1))
    assert missing.reason == "explicit_parent_tokens_missing"


# Computed by the straightforward implementation before the digests were made faster (D185):
# any change to the hashed layout or to the ledger line fails here, and old ledgers stop matching.
_GOLDEN_ITEMS: list[dict[str, Any]] = [
    {"role": "system", "content": "counter"},
    {"role": "user", "content": "héllo ✓", "name": "ann"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"name": "add", "arguments": '{"b": 1, "a": "é"}', "id": "t1"},
            {"name": "noop", "arguments": "not json"},
        ],
    },
    {"role": "tool", "content": "2", "tool_call_id": "t1"},
    {"role": "assistant", "content": "done", "reasoning": "never hashed"},
]


def test_the_digests_and_the_ledger_line_are_byte_for_byte_stable() -> None:
    assert assistant_fingerprint(_GOLDEN_ITEMS) == (
        "fbfcc81fc5cc63f668f70590d97378aac0e7eac411f42fd5dab3d6383eb6f992"
    )
    assert conversation_digest(_GOLDEN_ITEMS) == (
        "477758180e2308f8118e0c04e62b62641c54d7514be3d62c08864a9ff5d6e7e4"
    )
    assert conversation_digest([]) == (
        "ed8c4d4ffa94d6b63f9a64aae5c779f1043d77460b12e94e9ae9d43b6bb550c6"
    )
    # A row a restore carried over, stamped as the import stamps it (D222 keeps the stamp).
    line = encode_row(dict(custody_row(commit("r-a1", 2)), capture_key="r-a1"))
    assert line == (
        b'{"admitted_at":1.5,"capture_key":"r-a1","chain_hash":"d58384f424abb184811c38fb6d51c0f7'
        b'0d653cb2398067bf5aad4394eff94a5d","context_digest":"60adea85651166ed2085f53e558a8aa95dd'
        b'682313b7ff8461e4774b60bae074d","context_len":6,"continuation_fingerprint":null,"cum_len"'
        b':15,"cumulative_hash":"3b37507b54914c2898c0a52c2d9a1249e8ed604916036da1ee467ce293499335'
        b'","delta_len":5,"digest":"3b37507b54914c2898c0a52c2d9a1249e8ed604916036da1ee467ce293499'
        b'335","extras_digest":"8631cffb5079412ce2bd60eedf4ec6785d34e596b3160ea918b618921b0be999",'
        b'"fingerprint":"38b0a51565a6028ee780e10646a20fd4f1bf473acb3c47bbc142ff6a40e737d8","finge'
        b'rprint_version":1,"mode":"token_in","model_call_id":"call-2","output_fingerprint":null,"'
        b'parent_call_id":"call-1","prev_len":10,"response_id":"resp-call-2","staging_chain":["st'
        b'age/r-a1/call-0","stage/r-a1/call-1","stage/r-a1/call-2"],"staging_digest":"e0e6155568e'
        b'fa3f92aa24ece37399518e689b537072ec11c0feb6f0e279fdc99","staging_key":"stage/r-a1/call-2"'
        b',"weight_version":1}\n'
    )


def test_request_items_are_validated_as_one_list_keeping_the_validated_ones() -> None:
    """D430: dicts become items, items validated already are the same objects, and a bad item
    is named by its index."""
    from pydantic import ValidationError

    from protocols import as_request_items
    from protocols._lineage import RequestItem

    kept = RequestItem(role="assistant", content="done")
    items = as_request_items(({"role": "user", "content": "hi"}, kept))
    assert items == [RequestItem(role="user", content="hi"), kept]
    assert items[1] is kept
    assert as_request_items(tuple(items)) == items  # a tuple, as a commit keeps them
    with pytest.raises(ValidationError) as refused:
        as_request_items([kept, {"role": ""}])
    assert refused.value.errors()[0]["loc"] == (1, "role")
