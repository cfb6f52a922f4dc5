"""Staged call records: what an inference worker stages, and what it acknowledges.

A model server admits a call with a :class:`CaptureAdmission` (wire name ``ng_capture``): who the
call is, which call it extends and the exact token prefix it must start with. The worker generates,
stages a :class:`StagedCallRecord` (the call's token delta, masks and log-probs, bound by the
staging digest) in a :class:`TokenStagingStore`, and answers :class:`CommitCoords` (wire name
``ng_commit_coords``), which the model server turns into a token-free ledger row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, NamedTuple, Protocol, Self, TypeVar

from pydantic import Field, ModelWrapValidatorHandler, ValidationInfo, model_validator

from ._cuts import GenerationCutContinuation
from ._extras_digest import EMPTY_EXTRAS_DIGEST, compute_extras_digest
from ._hashes import _staging_digest_blocks
from ._strict import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    DigestHex,
    DigestWireModel,
    ExactFloats,
    Identifier,
    NonNegativeInt,
    StagingWireModel,
)

CaptureMode = Literal["text", "token_in"]
CaptureDisposition = Literal["staged", "capture_failed"]
GENERATION_CUT_KEY_PREFIX: Final = "__generation_cut__"

# Passed as validation context by ``StagedCallRecord.from_components`` only: the digest was just
# computed from these very fields, so validation need not compute it a second time.
_DIGEST_JUST_COMPUTED: Final = object()
_CONTEXT_KEY: Final = "midflight.staged_digest"


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """The staging key of a completed call: ``<capture key>/<model call id>``."""
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"


def generation_cut_staging_key(model_call_id: str, sequence: int) -> str:
    """The staging key of one cut chunk: ``__generation_cut__/<model call id>/<sequence>``.

    Cut keys name no rollout; the record they hold says whose tokens they are.
    """
    if not model_call_id or sequence < 1:
        raise ValueError("a cut key needs a model call id and a sequence number from 1")
    return f"{GENERATION_CUT_KEY_PREFIX}/{model_call_id}/{sequence}"


class CaptureAdmission(StagingWireModel):
    """The model server's contract for one call: identity, lineage and exact token prefix.

    A ``token_in`` call names its parent, ``prev_len > 0`` and the parent's chain hash, and carries
    its prefix inline (``required_prefix_token_ids``, exactly ``prev_len`` ids) or as a
    ``staging_chain`` of staged records to fetch. A ``text`` call is a bare root. Either may carry a
    ``generation_cut`` to continue.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt = 0
    mode: CaptureMode
    required_prefix_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    staging_chain: list[Identifier] = Field(default_factory=list)
    parent_chain_hash: DigestHex | None = None
    generation_cut: GenerationCutContinuation | None = None

    @model_validator(mode="after")
    def _check_prefix_contract(self) -> Self:
        inline = self.required_prefix_token_ids
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len == 0:
                raise ValueError("a token_in admission needs parent_call_id and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError("a token_in admission needs the parent's chain hash")
            if not self.staging_chain and len(inline) != self.prev_len:
                raise ValueError("required_prefix_token_ids must hold exactly prev_len ids")
            if inline and len(inline) != self.prev_len:
                raise ValueError("an inline prefix must hold exactly prev_len ids")
        elif (
            self.parent_call_id is not None
            or self.prev_len != 0
            or inline
            or self.staging_chain
            or self.parent_chain_hash is not None
        ):
            raise ValueError("a text admission must be a bare root with no prefix")
        return self


class EncodedColumns(NamedTuple):
    """A staged record's three columns as its staging digest encodes them, without the blocks'
    leading counts: each token id a u64, each mask and log-prob a float32, big-endian."""

    tokens: bytes
    masks: bytes
    log_probs: bytes


class StagedCallRecord(DigestWireModel):
    """One staged token delta of a call, bound by its staging digest.

    ``token_ids_delta`` is the prompt past ``prev_len`` (mask 0.0, log-prob 0.0) followed by the
    generated tokens (mask 1.0). Validation recomputes the digest and the extras digest, so a
    record read from anywhere proves its own integrity. Build new records with
    :meth:`from_components`, which computes the digest exactly once.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    mode: CaptureMode
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    token_ids_delta: list[NonNegativeInt]
    token_mask_delta: ExactFloats
    generation_log_probs_delta: ExactFloats
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    extras: dict[str, Any] | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _check_digests(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo
    ) -> Self:
        if isinstance(data, cls):
            return data  # a record instance was verified (or built) when it was made
        record = handler(data)
        context = info.context
        if isinstance(context, dict) and context.get(_CONTEXT_KEY) is _DIGEST_JUST_COMPUTED:
            return record
        if compute_extras_digest(record.extras) != record.extras_digest:
            raise ValueError("extras_digest does not match extras")
        if _staging_digest_of(vars(record)) != record.digest:
            raise ValueError("digest does not match the staged call")
        return record

    @classmethod
    def from_components(
        cls,
        *,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        mode: CaptureMode,
        prev_len: int,
        weight_version: int,
        token_ids_delta: Sequence[int],
        token_mask_delta: Sequence[float],
        generation_log_probs_delta: Sequence[float],
        chain_hash: str,
        cumulative_hash: str,
        extras: dict[str, Any] | None = None,
    ) -> Self:
        """Build a record, computing its staging digest and extras digest once each.

        Raises:
            ValueError: A structural rule is broken or a value cannot be encoded (pydantic's
                ``ValidationError`` is a ``ValueError``).
            TypeError: The extras hold an unsupported type.
        """
        return cls.encoded_from_components(
            rollout_id=rollout_id,
            model_call_id=model_call_id,
            parent_call_id=parent_call_id,
            mode=mode,
            prev_len=prev_len,
            weight_version=weight_version,
            token_ids_delta=token_ids_delta,
            token_mask_delta=token_mask_delta,
            generation_log_probs_delta=generation_log_probs_delta,
            chain_hash=chain_hash,
            cumulative_hash=cumulative_hash,
            extras=extras,
        )[0]

    @classmethod
    def encoded_from_components(
        cls,
        *,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        mode: CaptureMode,
        prev_len: int,
        weight_version: int,
        token_ids_delta: Sequence[int],
        token_mask_delta: Sequence[float],
        generation_log_probs_delta: Sequence[float],
        chain_hash: str,
        cumulative_hash: str,
        extras: dict[str, Any] | None = None,
        token_elements: bytes | None = None,
    ) -> tuple[Self, EncodedColumns]:
        """:meth:`from_components`, and the record's columns as its staging digest encoded them.

        A :class:`~protocols.StagedPrefix` hashes those bytes again in every later cut round of
        the call; handed over here, no column is encoded twice (D423).

        Args:
            token_elements: ``encode_token_elements(token_ids_delta)`` when the caller made it
                already (for the record's chain and cumulative hashes): not encoded again.

        Raises:
            ValueError: As :meth:`from_components`.
            TypeError: As :meth:`from_components`.
        """
        tokens = list(token_ids_delta)
        fields: dict[str, Any] = {  # in the order of the model's fields, as pydantic keeps them
            "schema_version": STAGING_SCHEMA_VERSION,
            "digest_version": STAGING_DIGEST_VERSION,
            "extras_digest_version": EXTRAS_DIGEST_VERSION,
            "rollout_id": rollout_id,
            "model_call_id": model_call_id,
            "parent_call_id": parent_call_id,
            "mode": mode,
            "prev_len": prev_len,
            "delta_len": len(tokens),
            "cum_len": prev_len + len(tokens),
            "weight_version": weight_version,
            "digest": "",
            "token_ids_delta": tokens,
            "token_mask_delta": list(token_mask_delta),
            "generation_log_probs_delta": list(generation_log_probs_delta),
            "extras_digest": compute_extras_digest(extras),
            "chain_hash": chain_hash,
            "cumulative_hash": cumulative_hash,
            "extras": extras,
        }
        digest, *elements = _staging_digest_blocks(
            **{name: fields[name] for name in _DIGEST_FIELDS}, token_elements=token_elements
        )
        fields["digest"] = digest
        columns = EncodedColumns(*elements)
        if extras is None or type(extras) is dict:
            # Computing the two digests checked every field as strictly as validation would
            # (exact types, ranges, lengths, digest patterns, the structural rules; D346), so
            # the record is built without a second pass. A test pins the two paths together.
            fields["extras"] = None if extras is None else dict(extras)  # as validation copies
            return _trusted(cls, fields), columns
        record = cls.model_validate(fields, context={_CONTEXT_KEY: _DIGEST_JUST_COMPUTED})
        return record, columns

    @property
    def generated_token_count(self) -> int:
        """Tokens the model generated in this delta (mask 1.0)."""
        return sum(1 for mask in self.token_mask_delta if mask == 1.0)


_Record = TypeVar("_Record", bound="StagedCallRecord")


def _trusted(cls: type[_Record], fields: dict[str, Any]) -> _Record:
    """What ``cls.model_construct(**fields)`` makes of a value for every field, in field order,
    without its per-field loop (D417): the instance's ``__dict__`` is ``fields`` itself."""
    record = cls.__new__(cls)
    object.__setattr__(record, "__dict__", fields)
    object.__setattr__(record, "__pydantic_fields_set__", set(fields))
    object.__setattr__(record, "__pydantic_extra__", None)
    object.__setattr__(record, "__pydantic_private__", None)
    return record


_DIGEST_FIELDS: Final = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "token_ids_delta",
    "token_mask_delta",
    "generation_log_probs_delta",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


def _staging_digest_of(values: Mapping[str, Any]) -> str:
    """The staging digest of a record's fields (the digest itself and the extras excluded)."""
    return _staging_digest_blocks(**{name: values[name] for name in _DIGEST_FIELDS})[0]


class CommitCoords(DigestWireModel):
    """The worker's acknowledgement of one call (wire name ``ng_commit_coords``).

    ``staged`` carries the digest, extras digest, staging key, chain and cumulative hash and a
    non-empty delta; ``capture_failed`` carries none of them and ``delta_len`` 0.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    disposition: CaptureDisposition = "staged"
    digest: DigestHex | None = None
    extras_digest: DigestHex | None = None
    staging_key: Identifier | None = None
    chain_hash: DigestHex | None = None
    cumulative_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _check_disposition(self) -> Self:
        if (self.parent_call_id is None) != (self.prev_len == 0):
            raise ValueError("coordinates without a parent have prev_len 0, and only those")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        payload = (
            self.digest,
            self.extras_digest,
            self.staging_key,
            self.chain_hash,
            self.cumulative_hash,
        )
        if self.disposition == "staged":
            if any(value is None for value in payload) or self.delta_len == 0:
                raise ValueError(
                    "staged coordinates need a non-empty delta, digest, extras_digest, "
                    "staging_key, chain_hash and cumulative_hash"
                )
        elif any(value is not None for value in payload) or self.delta_len != 0:
            raise ValueError("capture_failed coordinates carry no staged payload and no delta")
        return self


class StagedEntry(StagingWireModel):
    """What a token staging store holds under one key: the record and opaque attachments.

    Attachments ride with the record but are never hashed.
    """

    staging_key: Identifier
    record: StagedCallRecord
    attachments: dict[str, Any] | None = None


class TokenStagingStore(Protocol):
    """Where a worker stages token records, keyed by staging key.

    Implementations are blocking; async callers run them on a worker thread.
    """

    def put(self, entry: StagedEntry) -> None:
        """Store ``entry`` under ``entry.staging_key``, replacing any entry there.

        The entry is durable before ``put`` returns.
        """

    def get(self, staging_key: str) -> StagedEntry | None:
        """The entry under ``staging_key``, validated, or ``None`` when there is none."""

    def delete(self, staging_key: str) -> bool:
        """Remove the entry under ``staging_key``; whether there was one."""
