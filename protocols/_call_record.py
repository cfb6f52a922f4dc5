"""``CallRecord``: one token-free row of a rollout's capture-ledger manifest.

It names where a call's tokens are staged (``staging_key``) and binds them with digests, but
carries no tokens itself.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import SerializerFunctionWrapHandler, model_serializer, model_validator

from ._strict import DigestHex, DigestWireModel, ExactFloat, Identifier, NonNegativeInt


class CallRecord(DigestWireModel):
    """One committed model call in a capture-ledger manifest.

    Attributes:
        model_call_id: The call.
        parent_call_id: The call whose tokens this one extends; ``None`` for a root.
        prev_len: Tokens before this call's delta (0 for a root).
        delta_len: Tokens this call staged (at least one).
        cum_len: ``prev_len + delta_len``.
        weight_version: The oldest policy version that produced the call's tokens.
        digest: The staging digest v2 of the staged record.
        extras_digest: The digest of the staged record's extras.
        staging_key: Where the staged record lives.
        mode: ``text`` for a root, ``token_in`` for a child.
        chain_hash: The chain hash of the call's delta on its parent's.
        cumulative_hash: The cumulative hash of every token up to the end of this call.
        response_id: The response envelope id seen before the model server answered.
        admitted_at: Wall-clock admission time stamped by the model server, if any.
        output_fingerprint: Fingerprint of the call's output items, if computable.
        continuation_fingerprint: Fingerprint of the request followed by the output, if computable.
        fingerprint_version: Canonicalization version of the fingerprints (0: none recorded).
        capture_key: The capture key the call was staged under; only set on rows a restore
            carried over, and only emitted when set.
    """

    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    extras_digest: DigestHex
    staging_key: Identifier
    mode: Literal["text", "token_in"] = "token_in"
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    response_id: Identifier
    admitted_at: ExactFloat | None = None
    output_fingerprint: DigestHex | None = None
    continuation_fingerprint: DigestHex | None = None
    fingerprint_version: NonNegativeInt = 0
    capture_key: Identifier | None = None

    @model_validator(mode="after")
    def _check_lineage(self) -> Self:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError(
                "a call record needs delta_len > 0 and cum_len == prev_len + delta_len"
            )
        is_root = self.parent_call_id is None
        if is_root != (self.prev_len == 0) or is_root != (self.mode == "text"):
            raise ValueError(
                "a root has no parent, prev_len 0 and mode text; a child has a parent, "
                "prev_len > 0 and mode token_in"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_capture_key(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Rows that no restore carried keep the reference shape: no capture_key key at all.
        data: dict[str, Any] = handler(self)
        if data.get("capture_key") is None:
            data.pop("capture_key", None)
        return data
