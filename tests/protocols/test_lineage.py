"""The single lineage matcher, its explicit variant, and the two digests."""

from __future__ import annotations

from typing import Any

from protocols import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    conversation_digest,
    custody_row,
    failure_row,
    resolve_explicit_rows,
    resolve_rows,
)
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
