"""``CallRecord``: the token-free record of one committed model call.

A worker stages a call's tokens under a staging key and acknowledges it with coordinates; the
policy server keeps those coordinates, without tokens, in the capture ledger, and a rollout's
manifest lists one ``CallRecord`` per committed call. The fields are exactly the reference's
(policy-model-and-ledger §2.4/§2.5 and errata 7.1), so a client whose ``CallRecord`` forbids extra
fields reads every manifest: the capture key a record belongs to is the manifest's ``rollout_id``,
and where a carried-over call was staged is named by its ``staging_key`` (D221, D222).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

_HEX64 = r"^[0-9a-f]{64}$"


def _finite_or_none(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("admitted_at must be a finite number of seconds or null")
    return value


class CallRecord(BaseModel):
    """One committed model call of a rollout, as a manifest lists it.

    Attributes:
        schema_version: Always 2.
        digest_version: The staging-digest layout version; always 2.
        extras_digest_version: The extras-digest layout version; always 1.
        model_call_id: The call's id, unique within the ledger.
        parent_call_id: The call this one continues; ``None`` for a root.
        staging_key: Where the worker staged the call's token delta.
        weight_version: The oldest policy weight version that produced the delta.
        prev_len: Tokens inherited from the parent (0 for a root).
        delta_len: Tokens this call added (at least 1).
        cum_len: ``prev_len + delta_len``.
        digest: The worker's staged-record digest.
        extras_digest: Digest of the staged extras.
        mode: ``"text"`` for a root, ``"token_in"`` for a continuation.
        admitted_at: Wall-clock admission time, or ``None``.
        chain_hash: Hash chaining every delta of the ancestry.
        cumulative_hash: Hash of the cumulative token ids.
        response_id: The id of the response that delivered the call.
        output_fingerprint: Fingerprint of the call's output, when known.
        continuation_fingerprint: Fingerprint a continuation of this call presents, when known.
        fingerprint_version: The fingerprint algorithm version.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_version: Literal[2] = 2
    digest_version: Literal[2] = 2
    extras_digest_version: Literal[1] = 1
    model_call_id: str = Field(min_length=1)
    parent_call_id: str | None = Field(default=None, min_length=1)
    staging_key: str = Field(min_length=1)
    weight_version: int = Field(ge=0)
    prev_len: int = Field(ge=0)
    delta_len: int = Field(ge=1)
    cum_len: int = Field(ge=1)
    digest: str = Field(pattern=_HEX64)
    extras_digest: str = Field(pattern=_HEX64)
    mode: Literal["text", "token_in"]
    admitted_at: Annotated[float | None, AfterValidator(_finite_or_none)] = None
    chain_hash: str = Field(pattern=_HEX64)
    cumulative_hash: str = Field(pattern=_HEX64)
    response_id: str = Field(min_length=1)
    output_fingerprint: str | None = None
    continuation_fingerprint: str | None = None
    fingerprint_version: int = Field(ge=0)

    @model_validator(mode="after")
    def _lineage_is_consistent(self) -> Self:
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        root = self.parent_call_id is None
        if root != (self.prev_len == 0) or root != (self.mode == "text"):
            raise ValueError(
                "a root has no parent, prev_len 0 and mode 'text'; a child has a parent, "
                "prev_len > 0 and mode 'token_in'"
            )
        return self
