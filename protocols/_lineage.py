"""Lineage: which recorded call a new request continues.

Two digests decide it. The **assistant fingerprint** hashes only the model-authored turns of a
conversation (user and tool content added between calls does not change it), so a request that
continues call C presents the fingerprint C's request + response had. The **conversation digest**
hashes the first ``context_len`` request items and proves the context C saw was not rewritten.
Reasoning text is left out of both: harnesses often drop it when they echo a response back.

One matcher serves every path: candidates are filtered by fingerprint, fingerprint version and
context digest first, then counted. Several candidates with the same tokens (equal ``digest`` and
``cum_len``) are one answer (the smallest call id); otherwise more than one is ``ambiguous`` —
identical-output siblings are never guessed between. Failure rows carry no fingerprint and never
resolve.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

FINGERPRINT_VERSION: Final = 1
"""Version of the fingerprint and conversation-digest layouts below; rows of another version
never match."""

_FINGERPRINT_DOMAIN: Final = b"midflight-lineage-fingerprint-v1"
_CONTEXT_DOMAIN: Final = b"midflight-lineage-context-v1"
_U64: Final = struct.Struct(">Q").pack
_EMPTY_FIELD: Final = _U64(0)
_NO_TOOL_CALLS: Final = _U64(0)


class ToolCallItem(BaseModel):
    """A tool call the model made; arguments are hashed as canonical JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""
    id: str | None = None


class RequestItem(BaseModel):
    """One conversation item of a model request, as lineage hashes it.

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``tool`` or another role name.
        content: The item's text.
        reasoning: Model reasoning; never hashed.
        tool_calls: Tool calls of an assistant item.
        tool_call_id: For a tool reply, the call it answers.
        name: An optional author name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(min_length=1)
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCallItem, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


RequestItems = Sequence[RequestItem | Mapping[str, Any]]
"""Request items as models or as the plain dicts a request body carries."""


_REQUEST_ITEMS: Final = TypeAdapter(list[RequestItem])
"""Validates a whole request's items in one call: about half the cost of one ``model_validate``
per item, which a long conversation pays on every captured call (D430)."""


def as_request_items(items: RequestItems) -> list[RequestItem]:
    """Validate request items (dicts become ``RequestItem``; items already validated are kept
    as they are).

    Raises:
        pydantic.ValidationError: An item is malformed (its location starts with its index).
    """
    return _REQUEST_ITEMS.validate_python(items if isinstance(items, list | tuple) else list(items))


def _field(value: str) -> bytes:
    # A u64 big-endian byte count, then UTF-8: unambiguous whatever bytes the text contains.
    encoded = value.encode("utf-8")
    return _U64(len(encoded)) + encoded


def _canonical_arguments(arguments: str | dict[str, Any]) -> str:
    value: Any = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments else {}
        except ValueError:
            return arguments  # not JSON: hash the text as it is
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _tool_calls(item: RequestItem) -> bytes:
    calls = item.tool_calls
    if not calls:
        return _NO_TOOL_CALLS  # most items: skip building the same eight bytes again
    out = [_U64(len(calls))]
    for call in calls:
        out += (_field(call.name), _field(_canonical_arguments(call.arguments)))
    return b"".join(out)


def assistant_fingerprint(items: RequestItems) -> str:
    """SHA-256 hex over the assistant items only; ``""`` when there are none (a root request)."""
    # One update over the joined parts: the same bytes as one update per part, fewer calls.
    parts = [_FINGERPRINT_DOMAIN]
    for item in as_request_items(items):
        if item.role == "assistant":
            parts += (_field(item.content), _tool_calls(item))
    seen = (len(parts) - 1) // 2
    if seen == 0:
        return ""
    parts.append(_U64(seen))
    return hashlib.sha256(b"".join(parts)).hexdigest()


def conversation_digest(items: RequestItems) -> str:
    """SHA-256 hex over every item (role, content, tool calls, tool call id, name), in order."""
    checked = as_request_items(items)
    parts = [_CONTEXT_DOMAIN, _U64(len(checked))]
    for item in checked:
        tool_call_id, name = item.tool_call_id, item.name
        parts += (
            _field(item.role),
            _field(item.content),
            _tool_calls(item),
            _field(tool_call_id) if tool_call_id else _EMPTY_FIELD,
            _field(name) if name else _EMPTY_FIELD,
        )
    return hashlib.sha256(b"".join(parts)).hexdigest()


class LineageMatch(BaseModel):
    """The parent a request continues.

    Custody rows resolve token-free: ``cumulative_token_ids`` is empty and the worker fetches the
    parent's tokens through ``staging_chain``; lineage-only rows carry the tokens inline.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str
    prev_len: int
    digest: str
    cumulative_token_ids: tuple[int, ...] = ()
    chain_hash: str | None = None
    staging_chain: tuple[str, ...] = ()


class LineageResolution(BaseModel):
    """A parent decision: ``root``, ``resolved`` (with ``match``) or ``unresolved`` (a reason)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Literal["root", "resolved", "unresolved"]
    match: LineageMatch | None = None
    reason: str | None = None


ROOT: Final = LineageResolution(status="root")


def _unresolved(reason: str) -> LineageResolution:
    return LineageResolution(status="unresolved", reason=reason)


def _match_of(row: Mapping[str, Any]) -> LineageMatch:
    tokens = tuple(row.get("cumulative_token_ids") or ())
    cum_len = row["cum_len"] if "cum_len" in row else len(tokens)
    return LineageMatch(
        model_call_id=row["model_call_id"],
        prev_len=cum_len,
        digest=row["digest"],
        cumulative_token_ids=tokens,
        chain_hash=row.get("chain_hash"),
        staging_chain=tuple(row.get("staging_chain") or ()),
    )


def _continues(row: Mapping[str, Any], fingerprint: str, items: list[RequestItem]) -> bool:
    if row.get("fingerprint") != fingerprint:
        return False
    if row.get("fingerprint_version") != FINGERPRINT_VERSION:
        return False
    context_len = row.get("context_len")
    if not isinstance(context_len, int) or not 0 <= context_len <= len(items):
        return False
    return row.get("context_digest") == conversation_digest(items[:context_len])


def resolve_rows(
    rows: Iterable[Mapping[str, Any]], request_items: RequestItems
) -> LineageResolution:
    """The single matcher: which row of a ledger ``request_items`` continues."""
    items = as_request_items(request_items)
    fingerprint = assistant_fingerprint(items)
    if not fingerprint:
        return ROOT
    candidates = [row for row in rows if _continues(row, fingerprint, items)]
    if not candidates:
        return _unresolved("no_match")
    if len({(row.get("digest"), _cum_len(row)) for row in candidates}) > 1:
        return _unresolved("ambiguous")
    winner = min(candidates, key=lambda row: str(row["model_call_id"]))
    return LineageResolution(status="resolved", match=_match_of(winner))


def _cum_len(row: Mapping[str, Any]) -> int:
    if "cum_len" in row:
        return int(row["cum_len"])
    return len(row.get("cumulative_token_ids") or ())


def resolve_explicit_rows(
    rows: Iterable[Mapping[str, Any]], parent_call_id: str, request_items: RequestItems
) -> LineageResolution:
    """Check a parent the caller names instead of searching for one.

    Reasons: ``explicit_parent_missing`` (no resolvable row with that id),
    ``explicit_parent_fingerprint_mismatch`` (the request does not continue it),
    ``explicit_parent_tokens_missing`` (the row cannot supply its parent tokens).
    """
    items = as_request_items(request_items)
    parent = next(
        (
            row
            for row in rows
            if row.get("model_call_id") == parent_call_id and "fingerprint" in row
        ),
        None,
    )
    if parent is None:
        return _unresolved("explicit_parent_missing")
    if not _continues(parent, assistant_fingerprint(items), items):
        return _unresolved("explicit_parent_fingerprint_mismatch")
    if "cumulative_token_ids" in parent:
        if len(parent["cumulative_token_ids"]) == 0:
            return _unresolved("explicit_parent_tokens_missing")
    elif not parent.get("chain_hash") or not parent.get("staging_chain"):
        return _unresolved("explicit_parent_tokens_missing")
    return LineageResolution(status="resolved", match=_match_of(parent))
