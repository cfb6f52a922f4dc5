"""Generation cuts on the wire: the inventory a model server sends, the receipt a worker answers.

At a checkpoint the policy-model server asks each inference worker to make the tokens generated so
far by its undelivered calls durable, without stopping them. The worker answers one ack per call:
``durable_prefix`` (the prefix is staged; a replacement call may continue it) or
``durable_failure`` (it is not; the call regenerates). Returning the receipt is the worker's
durability boundary. A continued call carries a :class:`GenerationCutContinuation`. The worker
serves the inventory at :data:`GENERATION_CUT_PATH`, under its control token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Any, Final, Literal, Self

from pydantic import Field, ValidationInfo, model_validator

from ._ids import MAX_ATTEMPT, CheckpointId, EpisodeId, RolloutId
from ._strict import (
    DigestHex,
    ExactFloat,
    Identifier,
    NonNegativeInt,
    StagingWireModel,
    StrictWireModel,
)

GENERATION_CUT_PATH: Final = "/ng-control/v1/generation-cut"
"""Where a worker takes a cut inventory (``POST``, bearer control token), below its control root."""

VERIFIED_INVENTORY: Final = "midflight.verified_inventory"
"""Validation-context key: an inventory whose digest is already checked.

A receipt validated with ``context={VERIFIED_INVENTORY: inventory}`` (the worker embedding the
inventory it parsed, the policy server reading its worker's answer before ``validate_for``) does
not compute its embedded inventory's digest again when that inventory equals ``inventory``: the
digest is a canonical JSON and a SHA-256 of every prefix, the largest single cost of a cut round
at thousands of calls.
"""
_BUILT_DIGEST: Final = "midflight.inventory_digest_built"

CutDisposition = Literal["durable_prefix", "durable_failure"]
CutKind = Literal["active_prefix", "terminal_completion"]
FinishReason = Literal["stop", "length"]


def capture_key_of(rollout_id: str, attempt: int) -> str:
    """``EpisodeId.capture_key`` of fields a wire model has validated already (no new model)."""
    if attempt > MAX_ATTEMPT:
        return EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key  # raises, as ever
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def _unique(values: Sequence[str], what: str) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{what} must be unique")


class GenerationCutPrefix(StrictWireModel):
    """One undelivered call whose generated prefix should be made durable.

    Attributes:
        ticket_id: The model server's ticket of the call.
        rollout_id: The call's rollout.
        attempt: The call's attempt.
        model_call_id: The call, as the worker knows it.
        admitted_at: When the model server admitted the call (wall clock).
    """

    ticket_id: Identifier
    rollout_id: RolloutId
    attempt: NonNegativeInt
    model_call_id: Identifier
    admitted_at: ExactFloat

    @property
    def capture_key(self) -> str:
        """The capture key of the call's attempt."""
        return capture_key_of(self.rollout_id, self.attempt)

    def identity(self) -> tuple[str, str, int, str, float]:
        """``(ticket_id, rollout_id, attempt, model_call_id, admitted_at)``: what an ack repeats."""
        return (self.ticket_id, self.rollout_id, self.attempt, self.model_call_id, self.admitted_at)

    def fields(self) -> dict[str, Any]:
        """The prefix's fields by name, equal to ``model_dump()`` and to its JSON mode (they are
        strings and numbers), read as attributes: a fifth of the cost at thousands of calls."""
        return {
            "ticket_id": self.ticket_id,
            "rollout_id": self.rollout_id,
            "attempt": self.attempt,
            "model_call_id": self.model_call_id,
            "admitted_at": self.admitted_at,
        }


_IDENTITY = attrgetter("ticket_id", "rollout_id", "attempt", "model_call_id", "admitted_at")
"""A prefix's or an ack's ``identity()``, read in C."""


def inventory_digest(
    checkpoint_id: str, server_name: str, active_prefixes: Iterable[GenerationCutPrefix]
) -> str:
    """SHA-256 hex of the canonical JSON of an inventory.

    The JSON is ``{"checkpoint_id", "server_name", "active_prefixes"}`` with the prefixes in JSON
    mode sorted by ``ticket_id``, sorted keys, compact separators, ASCII, floats in Python's repr.
    """
    prefixes = sorted(active_prefixes, key=lambda prefix: prefix.ticket_id)
    payload = {
        "checkpoint_id": checkpoint_id,
        "server_name": server_name,
        "active_prefixes": [prefix.fields() for prefix in prefixes],
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def same_prefixes(
    first: Sequence[GenerationCutPrefix], second: Sequence[GenerationCutPrefix]
) -> bool:
    """``list(first) == list(second)``, most of it in C.

    Two prefixes of one type whose ``__dict__`` are equal are equal: that is pydantic's own
    first test in ``__eq__``, which costs a few microseconds a pair in Python. Lists that fail
    it are compared with ``==`` after all, so the answer is always ``==``'s (D437).
    """
    if len(first) != len(second):
        return False
    if all(type(a) is type(b) for a, b in zip(first, second, strict=True)) and [
        a.__dict__ for a in first
    ] == [b.__dict__ for b in second]:
        return True
    return list(first) == list(second)


class GenerationCutInventory(StrictWireModel):
    """What one worker is asked to cut: every listed call, sorted by ticket, with a digest.

    Build it with :meth:`build`; validation checks the order, uniqueness and digest.
    """

    checkpoint_id: CheckpointId
    server_name: Identifier
    active_prefixes: list[GenerationCutPrefix] = Field(default_factory=list)
    inventory_digest: DigestHex

    @classmethod
    def build(
        cls,
        *,
        checkpoint_id: str,
        server_name: str,
        active_prefixes: Iterable[GenerationCutPrefix],
    ) -> Self:
        """The inventory of these prefixes, sorted by ticket, with its digest."""
        prefixes = sorted(active_prefixes, key=lambda prefix: prefix.ticket_id)
        digest = inventory_digest(checkpoint_id, server_name, prefixes)
        # Validated with the digest just computed from these very prefixes: not computed twice.
        return cls.model_validate(
            {
                "checkpoint_id": checkpoint_id,
                "server_name": server_name,
                "active_prefixes": prefixes,
                "inventory_digest": digest,
            },
            context={_BUILT_DIGEST: digest},
        )

    def _same_as_verified(self, context: object) -> bool:
        """Whether ``context`` names an already verified inventory equal to this one."""
        if not isinstance(context, dict):
            return False
        verified = context.get(VERIFIED_INVENTORY)
        return isinstance(verified, GenerationCutInventory) and verified.same_as(self)

    def same_as(self, other: GenerationCutInventory) -> bool:
        """``self == other``, with the prefixes compared by :func:`same_prefixes`."""
        return other is self or (
            type(other) is type(self)
            and other.inventory_digest == self.inventory_digest
            and other.checkpoint_id == self.checkpoint_id
            and other.server_name == self.server_name
            and same_prefixes(other.active_prefixes, self.active_prefixes)
        )

    @model_validator(mode="after")
    def _check_digest(self, info: ValidationInfo) -> Self:
        if self._same_as_verified(info.context):
            return self
        tickets = [prefix.ticket_id for prefix in self.active_prefixes]
        if tickets != sorted(tickets):
            raise ValueError("active_prefixes must be sorted by ticket_id")
        _unique(tickets, "ticket ids")
        built = info.context.get(_BUILT_DIGEST) if isinstance(info.context, dict) else None
        if built is not None and built == self.inventory_digest:
            return self  # build() computed it from these prefixes a moment ago
        expected = inventory_digest(self.checkpoint_id, self.server_name, self.active_prefixes)
        if self.inventory_digest != expected:
            raise ValueError("inventory_digest does not match the inventory")
        return self


class GenerationCutPrefixAck(StrictWireModel):
    """The worker's durable outcome for one call of the inventory.

    ``durable_prefix`` requires ``cut_kind``, ``frozen_buffer_id``, non-empty unique
    ``staging_keys``, ``prefix_token_count``, ``prefix_digest`` and ``effective_output_limit``;
    a ``terminal_completion`` also names its finish reason. ``durable_failure`` carries none of
    them but may carry ``terminal_finish_reason``. A stop reason needs a finish reason.
    """

    ticket_id: Identifier
    rollout_id: RolloutId
    attempt: NonNegativeInt
    model_call_id: Identifier
    admitted_at: ExactFloat
    disposition: CutDisposition
    cut_kind: CutKind | None = None
    frozen_buffer_id: Identifier | None = None
    staging_keys: list[Identifier] | None = None
    prefix_token_count: NonNegativeInt | None = None
    prefix_digest: DigestHex | None = None
    effective_output_limit: int | None = Field(default=None, ge=1)
    terminal_finish_reason: FinishReason | None = None
    terminal_stop_reason: str | int | None = None

    @model_validator(mode="after")
    def _check_evidence(self) -> Self:
        evidence = (
            self.cut_kind,
            self.frozen_buffer_id,
            self.staging_keys,
            self.prefix_token_count,
            self.prefix_digest,
            self.effective_output_limit,
        )
        if self.disposition == "durable_prefix":
            # ``None in`` and ``count``, not a generator: this runs once per ack (D437).
            if None in evidence or not self.staging_keys:
                raise ValueError(
                    "durable_prefix needs cut_kind, frozen_buffer_id, staging_keys, "
                    "prefix_token_count, prefix_digest and effective_output_limit"
                )
            _unique(self.staging_keys, "staging_keys")
            if self.cut_kind == "terminal_completion" and self.terminal_finish_reason is None:
                raise ValueError("a terminal_completion cut needs terminal_finish_reason")
            if self.cut_kind == "active_prefix" and self.terminal_finish_reason is not None:
                raise ValueError("an active_prefix cut has no terminal_finish_reason")
        elif evidence.count(None) != len(evidence):
            raise ValueError("durable_failure carries no prefix evidence")
        if self.terminal_stop_reason is not None and self.terminal_finish_reason is None:
            raise ValueError("terminal_stop_reason needs terminal_finish_reason")
        return self

    def identity(self) -> tuple[str, str, int, str, float]:
        """``(ticket_id, rollout_id, attempt, model_call_id, admitted_at)``."""
        return (self.ticket_id, self.rollout_id, self.attempt, self.model_call_id, self.admitted_at)

    @property
    def capture_key(self) -> str:
        """The capture key of the call's attempt."""
        return capture_key_of(self.rollout_id, self.attempt)

    def continuation(self) -> GenerationCutContinuation:
        """What a replacement call carries to continue this cut.

        Raises:
            ValueError: The ack is a ``durable_failure``.
        """
        if (
            self.disposition != "durable_prefix"
            or self.staging_keys is None
            or self.prefix_token_count is None
            or self.prefix_digest is None
            or self.effective_output_limit is None
        ):
            raise ValueError("only a durable_prefix ack can be continued")
        return GenerationCutContinuation(
            source_capture_key=self.capture_key,
            source_model_call_id=self.model_call_id,
            staging_keys=list(self.staging_keys),
            prefix_token_count=self.prefix_token_count,
            prefix_digest=self.prefix_digest,
            effective_output_limit=self.effective_output_limit,
            terminal_finish_reason=self.terminal_finish_reason,
            terminal_stop_reason=self.terminal_stop_reason,
        )

    @classmethod
    def failure(cls, prefix: GenerationCutPrefix, **terminal: Any) -> Self:
        """A ``durable_failure`` ack for ``prefix`` (optionally with its terminal finish reason)."""
        return cls(**prefix.fields(), disposition="durable_failure", **terminal)


class GenerationCutReceipt(StrictWireModel):
    """The worker's answer to an inventory: one ack per listed call, the inventory embedded."""

    checkpoint_id: CheckpointId
    cut_id: Identifier
    inventory_digest: DigestHex
    inventory: GenerationCutInventory
    backend_snapshot_id: Identifier
    prefixes: list[GenerationCutPrefixAck] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_embedded(self) -> Self:
        if self.checkpoint_id != self.inventory.checkpoint_id:
            raise ValueError("the receipt and its inventory name different checkpoints")
        if self.inventory_digest != self.inventory.inventory_digest:
            raise ValueError("the receipt and its inventory carry different digests")
        _unique([ack.ticket_id for ack in self.prefixes], "acked ticket ids")
        return self

    def validate_for(self, inventory: GenerationCutInventory) -> None:
        """Check that this receipt answers exactly ``inventory``.

        Raises:
            ValueError: Another inventory, a missing or extra ticket, or an ack whose identity
                differs from its prefix.
        """
        if (
            not self.inventory.same_as(inventory)
            or self.inventory_digest != inventory.inventory_digest
        ):
            raise ValueError("the receipt answers another inventory")
        # The inventory is sorted by ticket, its tickets unique and so are the acks': the acks'
        # identities, sorted, equal the prefixes' exactly when every ticket is acked once by an
        # ack naming its call. Only a receipt that fails looks for which ack is wrong (D437).
        if sorted(map(_IDENTITY, self.prefixes)) == list(map(_IDENTITY, inventory.active_prefixes)):
            return
        expected = {prefix.ticket_id: prefix for prefix in inventory.active_prefixes}
        if {ack.ticket_id for ack in self.prefixes} != set(expected):
            raise ValueError("the receipt must ack every ticket of the inventory exactly once")
        for ack in self.prefixes:
            if ack.identity() != expected[ack.ticket_id].identity():
                raise ValueError(f"the ack of ticket {ack.ticket_id!r} names another call")


class GenerationCutContinuation(StagingWireModel):
    """What a replacement call carries to continue a durable prefix.

    Attributes:
        source_capture_key: The capture key the prefix was staged under.
        source_model_call_id: The call that generated the prefix.
        staging_keys: The staged records whose concatenation is the prefix, in order.
        prefix_token_count: Generated tokens in the prefix (mask 1.0).
        prefix_digest: The staging digest of the concatenated prefix under the source identity.
        effective_output_limit: The output limit of the original call.
        terminal_finish_reason: Set when the source call had already finished.
        terminal_stop_reason: The stop reason of a finished source call, if any.
    """

    source_capture_key: Identifier
    source_model_call_id: Identifier
    staging_keys: list[Identifier] = Field(min_length=1)
    prefix_token_count: NonNegativeInt
    prefix_digest: DigestHex
    effective_output_limit: int = Field(ge=1)
    terminal_finish_reason: FinishReason | None = None
    terminal_stop_reason: str | int | None = None

    @model_validator(mode="after")
    def _check_keys(self) -> Self:
        _unique(self.staging_keys, "staging_keys")
        if self.terminal_stop_reason is not None and self.terminal_finish_reason is None:
            raise ValueError("terminal_stop_reason needs terminal_finish_reason")
        return self


class GenerationCutRecord(StrictWireModel):
    """A durable cut as a model server keeps it in a checkpoint.

    Attributes:
        model_call_id: The cut call.
        request_digest: The conversation digest of the call's request items; a replacement call
            continues the cut only if its request has the same digest.
        continuation: What the replacement call carries.
    """

    model_call_id: Identifier
    request_digest: DigestHex
    continuation: GenerationCutContinuation
