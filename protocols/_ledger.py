"""The capture ledger's contract: keys, rows, manifests, removal results and the protocol.

A capture ledger keeps, per capture key, the token-free rows of the model calls an attempt
committed (custody rows), the calls that failed (failure rows) and, on the local capture path,
lineage-only rows. Rows are plain JSON objects; the models below say what each kind holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ._call_record import CallRecord
from ._ledger_keys import validate_ledger_key
from ._lineage import (
    LineageResolution,
    RequestItem,
    RequestItems,
    assistant_fingerprint,
    conversation_digest,
)
from ._records import is_sha256_hex

MAX_LEDGER_BATCH: Final = 4096
"""Most ids one retire or delete request may carry."""
LEDGER_CONTROL_PREFIX: Final = "/training-token-capture/control"
LEDGER_ROW_MISSING_RESPONSE_ID_REASON: Final = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH_REASON: Final = "ledger_row_missing_chain_hash"
POISON_REASONS: Final = frozenset(
    {
        "unresolved_parent",
        "request_finished_without_staged_coordinates",
        "worker_response_missing_commit_coordinates",
        "worker_capture_failed",
        "invalid_worker_commit_coordinates",
        LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
        LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    }
)
"""The failure reasons the policy server writes; ``record_failure`` accepts any non-empty one."""


class CaptureLedgerCommit(BaseModel):
    """What ``record`` receives for one committed call.

    Attributes:
        schema_version: Always 2.
        rollout_id: The capture key of the attempt.
        record: The call's coordinates.
        staging_chain: Staging keys of the call's ancestry, ending with its own.
        request_items: The request's conversation items.
        response_items: The items the response added.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[2] = 2
    rollout_id: str
    record: CallRecord
    staging_chain: tuple[str, ...] = Field(min_length=1)
    request_items: tuple[RequestItem, ...]
    response_items: tuple[RequestItem, ...]
    _context_digest: str | None = PrivateAttr(default=None)
    """``conversation_digest(request_items)`` when the caller had it already (D429); never on
    the wire. Set only through :meth:`with_context_digest`."""

    def with_context_digest(self, digest: str) -> Self:
        """This commit, carrying the request's conversation digest computed at admission, so
        ``custody_row`` does not hash the whole request again (D429).

        Raises:
            ValueError: ``digest`` is not a lowercase SHA-256 hex digest.
        """
        if not is_sha256_hex(digest):
            raise ValueError("a context digest must be a lowercase SHA-256 hex digest")
        self._context_digest = digest
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        validate_ledger_key(self.rollout_id)
        if self.staging_chain[-1] != self.record.staging_key:
            raise ValueError("staging_chain must end with the record's own staging_key")
        return self


class CustodyRow(BaseModel):
    """A committed call's row. ``response_id`` and the hashes may be missing on old rows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = Field(min_length=1)
    fingerprint: str
    context_len: int = Field(ge=0)
    context_digest: str
    digest: str | None
    parent_call_id: str | None
    staging_key: str
    weight_version: int
    prev_len: int
    delta_len: int
    cum_len: int
    staging_digest: str
    extras_digest: str
    mode: str
    admitted_at: float | None = None
    staging_chain: list[str]
    chain_hash: str | None = None
    cumulative_hash: str | None = None
    response_id: str | None = None
    output_fingerprint: str | None = None
    continuation_fingerprint: str | None = None
    fingerprint_version: int
    # Set on rows carried over by a restore: the capture key the call was staged under. It stays
    # in the ledger and the checkpoint; a manifest never shows it (D222).
    capture_key: str | None = None


class FailureRow(BaseModel):
    """A failed (poisoned) call: exactly its id and reason; it never resolves as a parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = Field(min_length=1)
    failure_reason: str = Field(min_length=1)


class LineageOnlyRow(BaseModel):
    """A local-capture row: resolvable, carries its tokens, never listed in a manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = Field(min_length=1)
    fingerprint_version: int
    fingerprint: str
    context_len: int = Field(ge=0)
    context_digest: str
    cumulative_token_ids: list[int]
    digest: str


def validate_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Check that an imported row is one of the three kinds; returns it as a plain dict.

    Raises:
        ValueError: The row is not a JSON object of a known kind.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"a ledger row must be an object, not {type(row).__name__}")
    model: type[BaseModel]
    if "failure_reason" in row:
        model = FailureRow
    elif "cumulative_token_ids" in row:
        model = LineageOnlyRow
    else:
        model = CustodyRow
    model.model_validate(row)  # pydantic's ValidationError is a ValueError
    return dict(row)


def custody_row(commit: CaptureLedgerCommit) -> dict[str, Any]:
    """The full row ``record`` appends; a lossless round trip of the ``CallRecord``."""
    record = commit.record
    request = list(commit.request_items)
    row: dict[str, Any] = {
        "model_call_id": record.model_call_id,
        "fingerprint": assistant_fingerprint([*request, *commit.response_items]),
        "context_len": len(request),
        # The digest the policy server computed at admission, from these very items (D429).
        "context_digest": commit._context_digest or conversation_digest(request),
        "digest": record.cumulative_hash,
        "parent_call_id": record.parent_call_id,
        "staging_key": record.staging_key,
        "weight_version": record.weight_version,
        "prev_len": record.prev_len,
        "delta_len": record.delta_len,
        "cum_len": record.cum_len,
        "staging_digest": record.digest,
        "extras_digest": record.extras_digest,
        "mode": record.mode,
        "admitted_at": record.admitted_at,
        "staging_chain": list(commit.staging_chain),
        "chain_hash": record.chain_hash,
        "cumulative_hash": record.cumulative_hash,
        "response_id": record.response_id,
        "output_fingerprint": record.output_fingerprint,
        "continuation_fingerprint": record.continuation_fingerprint,
        "fingerprint_version": record.fingerprint_version,
    }
    return row


def failure_row(model_call_id: str, reason: str) -> dict[str, Any]:
    """The row ``record_failure`` appends."""
    if not model_call_id or not reason:
        raise ValueError("a failure row needs a model_call_id and a reason")
    return {"model_call_id": model_call_id, "failure_reason": reason}


# Built once: ``json.dumps`` with non-default options builds a new encoder on every call, which
# costs about as much as the encoding itself on the ledger's hot path.
_ROW_ENCODER: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def encode_row(row: Mapping[str, Any]) -> bytes:
    """One ledger line: sorted keys, compact separators, ASCII, then ``\\n``."""
    return _ROW_ENCODER.encode(row).encode() + b"\n"


class ManifestFailure(BaseModel):
    """A call of the rollout that produced no usable record, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[2] = 2
    model_call_id: str
    reason: str


class RolloutManifest(BaseModel):
    """The token-free manifest of one capture key: its records and failures in commit order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[2] = 2
    rollout_id: str
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


def manifest_from_rows(rollout_id: str, rows: Iterable[Mapping[str, Any]]) -> RolloutManifest:
    """Build a manifest from ledger rows; lineage-only rows are skipped.

    The records and failures are collected as plain dicts and validated in one call, the
    manifest's own schema checking every ``CallRecord`` (D257).
    """
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for row in rows:
        call_id = str(row.get("model_call_id"))
        if "failure_reason" in row:
            failures.append({"model_call_id": call_id, "reason": row["failure_reason"]})
        elif "cumulative_token_ids" in row:
            continue
        elif not row.get("response_id"):
            failures.append(
                {"model_call_id": call_id, "reason": LEDGER_ROW_MISSING_RESPONSE_ID_REASON}
            )
        elif not row.get("chain_hash") or not row.get("cumulative_hash"):
            failures.append(
                {"model_call_id": call_id, "reason": LEDGER_ROW_MISSING_CHAIN_HASH_REASON}
            )
        else:
            records.append(_call_record_fields(row))
    return RolloutManifest.model_validate(
        {"rollout_id": rollout_id, "records": records, "failures": failures}
    )


_ROW_ONLY_FIELDS: Final = frozenset(
    {
        "fingerprint",
        "context_len",
        "context_digest",
        "digest",
        "staging_digest",
        "staging_chain",
        # A carried-over row's stamp stays in the ledger and the checkpoint; a manifest names
        # where the call was staged by its staging_key alone (D222).
        "capture_key",
    }
)


def _call_record_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    fields = {key: value for key, value in row.items() if key not in _ROW_ONLY_FIELDS}
    fields["digest"] = row["staging_digest"]
    return fields


class RolloutRemoval(BaseModel):
    """What retire and delete report: ids that had a ledger, and ids that had none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    removed: list[str] = Field(default_factory=list)
    absent: list[str] = Field(default_factory=list)


class LedgerBatchRequest(BaseModel):
    """Body of the retire and delete routes: 1 to ``MAX_LEDGER_BATCH`` ids."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    rollout_ids: list[str] = Field(min_length=1, max_length=MAX_LEDGER_BATCH)


@runtime_checkable
class CaptureLedger(Protocol):
    """A capture ledger. Async methods never block the event loop; sync ones do file work and
    belong in a worker thread."""

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append a committed call (idempotent; a conflicting repeat raises ``ValueError``)."""

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Append a failure row."""

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The manifest; ``RolloutRetiredError`` when retired, empty when absent."""

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any row exists; ``RolloutRetiredError`` when retired."""

    async def resolve(self, rollout_id: str, request_items: RequestItems) -> LineageResolution:
        """Which recorded call the request continues."""

    async def resolve_explicit(
        self, source_capture_key: str, parent_call_id: str, request_items: RequestItems
    ) -> LineageResolution:
        """Check a named parent in another key's ledger."""

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Fence and remove ledgers; late rows are discarded afterwards."""

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Remove ledgers, fences and start markers."""

    async def delete_unstarted(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """``delete`` for ids without a start marker; started ids are in neither list."""

    async def mark_started(self, rollout_id: str) -> bool:
        """Mark a restored attempt started; ``False`` (and no marker) when it is retired."""

    def export_rows(self, rollout_id: str) -> list[dict[str, Any]]:
        """Every row in commit order; ``[]`` when there is no ledger."""

    def export_rows_many(self, rollout_ids: Sequence[str]) -> list[list[dict[str, Any]]]:
        """``export_rows`` of each id, in the order given (all ids checked first)."""

    def import_rows(self, rollout_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``import_rows_many({rollout_id: rows})``."""

    def import_rows_many(self, ledgers: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
        """Replace whole ledgers, wiping the target and later attempts' capture files first."""

    def close(self) -> None:
        """Drop caches and release locks."""
