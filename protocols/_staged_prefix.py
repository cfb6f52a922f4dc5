"""A call's staged cut records joined, with each record's columns encoded once (D420).

A cut round stages, for a call it cut before, only the tokens generated since (a chunk). But the
chunk's chain and cumulative hashes, and the digest its receipt names, cover the call's whole
staged prefix. Joining the records and encoding the joined columns again every round costs Python
work for every token of the prefix, every round. :class:`StagedPrefix` encodes each record's
columns once (when first needed) and hashes the encoded bytes as they are: a later round costs
per prefix token only the SHA-256 passes over its bytes.

The bytes hashed are exactly those of :func:`compute_chain_hash`, :func:`hash_token_ids` and the
staging digest of :meth:`StagedCallRecord.from_components` over the joined columns; tests pin
them together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Final

from ._hashes import (
    _PACK_U64,
    CUMULATIVE_HASH_DOMAIN,
    EMPTY_EXTRAS_DIGEST,
    _call_identity,
    _call_tail_of,
    _chain_head,
    _u64s,
    encode_float32_elements,
    encode_token_elements,
)
from ._layout import check_lineage
from ._staging import StagedCallRecord

_EMPTY_EXTRAS: Final = bytes.fromhex(EMPTY_EXTRAS_DIGEST)
_U64_BYTES: Final = 8
_F32_BYTES: Final = 4


class _Columns:
    """One record's columns, encoded on first use and then shared by every prefix holding it."""

    __slots__ = ("_log_probs", "_masks", "_record", "_tokens")

    def __init__(self, record: StagedCallRecord) -> None:
        self._record = record
        self._tokens: bytes | None = None
        self._masks: bytes | None = None
        self._log_probs: bytes | None = None

    def tokens(self) -> bytes:
        if self._tokens is None:
            self._tokens = encode_token_elements(self._record.token_ids_delta)
        return self._tokens

    def masks_and_log_probs(self) -> tuple[bytes, bytes]:
        if self._masks is None or self._log_probs is None:
            record = self._record
            self._masks = encode_float32_elements(record.token_mask_delta, field="token_mask_delta")
            self._log_probs = encode_float32_elements(
                record.generation_log_probs_delta, field="generation_log_probs_delta"
            )
        return self._masks, self._log_probs


class _Call:
    """What every prefix of one call shares: its parent tokens, encoded on first use (a child
    call's cumulative hash covers them), its chain hashes' head, and the staging digest's
    identity bytes."""

    __slots__ = ("_elements", "chain_head", "identity", "token_ids")

    def __init__(self, token_ids: Sequence[int], chain_head: bytes) -> None:
        self.token_ids = token_ids
        self.chain_head = chain_head
        self._elements: bytes | None = None
        self.identity: bytes | None = None

    def elements(self) -> bytes:
        if self._elements is None:
            self._elements = encode_token_elements(self.token_ids)
        return self._elements


def _identity(record: StagedCallRecord) -> tuple[str, str, str | None, str, int]:
    return (
        record.rollout_id,
        record.model_call_id,
        record.parent_call_id,
        record.mode,
        record.prev_len,
    )


class StagedPrefix:
    """One call's staged cut records, in order, as one prefix: its digest and a next chunk's
    hashes from columns encoded once.

    Immutable: :meth:`extended` answers a new prefix sharing this one's encodings, so a worker
    can compute a receipt's digest before the record is durable and keep the new prefix only
    once it is.

    Args:
        parent_chain_hash: The chain hash of the call's parent; ``None`` for a root call.
        prefix_token_ids: The call's parent tokens (``prev_len`` of them; none for a root call),
            kept and not copied: they must not change while the prefix is in use.
    """

    __slots__ = ("_call", "_columns", "_digest", "_parent_chain_hash", "_records")

    def __init__(
        self, *, parent_chain_hash: str | None = None, prefix_token_ids: Sequence[int] = ()
    ) -> None:
        self._parent_chain_hash = parent_chain_hash
        self._call = _Call(prefix_token_ids, _chain_head(parent_chain_hash))
        self._records: tuple[StagedCallRecord, ...] = ()
        self._columns: tuple[_Columns, ...] = ()
        self._digest: str | None = None

    @classmethod
    def of(
        cls,
        records: Iterable[StagedCallRecord],
        *,
        parent_chain_hash: str | None = None,
        prefix_token_ids: Sequence[int] = (),
    ) -> StagedPrefix:
        """The prefix of ``records`` (first the cumulative one, then chunks).

        Raises:
            ValueError: The records do not form one call's prefix (see :meth:`extended`).
        """
        prefix = cls(parent_chain_hash=parent_chain_hash, prefix_token_ids=prefix_token_ids)
        for record in records:
            prefix = prefix.extended(record)
        return prefix

    @property
    def records(self) -> tuple[StagedCallRecord, ...]:
        """The records, in order."""
        return self._records

    @property
    def parent_chain_hash(self) -> str | None:
        """The chain hash of the call's parent."""
        return self._parent_chain_hash

    @property
    def parent_token_count(self) -> int:
        """How many parent tokens the call's cumulative hash starts with."""
        return len(self._call.token_ids)

    @property
    def token_count(self) -> int:
        """Tokens in the staged records together."""
        return sum(record.delta_len for record in self._records)

    def __len__(self) -> int:
        return len(self._records)

    def extended(self, record: StagedCallRecord) -> StagedPrefix:
        """This prefix followed by ``record``, which must continue it: the same call, only
        generated tokens (a chunk), no extras, a policy version not older than the last.

        Raises:
            ValueError: ``record`` does not continue this prefix.
        """
        records = self._records
        if records:
            index = len(records)
            first, last = records[0], records[-1]
            if _identity(record) != _identity(first):
                raise ValueError(f"cut record {index} belongs to another call")
            masks = record.token_mask_delta
            if masks.count(1.0) != len(masks) or record.delta_len != len(masks):
                raise ValueError(f"cut record {index} holds prompt tokens; only the first may")
            if record.extras is not None:
                raise ValueError(f"cut record {index} carries extras; cut chunks carry none")
            if record.weight_version < last.weight_version:
                raise ValueError(
                    f"cut record {index} has an older policy version than its predecessor"
                )
            if first.extras is not None:
                raise ValueError(
                    "a chunked cut's first record carries extras; cut records carry none"
                )
        longer = StagedPrefix.__new__(StagedPrefix)
        longer._parent_chain_hash = self._parent_chain_hash
        longer._call = self._call
        longer._records = (*records, record)
        longer._columns = (*self._columns, _Columns(record))
        longer._digest = None
        return longer

    @property
    def digest(self) -> str:
        """The staging digest of the joined records: ``rebuild_generation_cut(records).digest``.

        Raises:
            ValueError: The prefix holds no record.
        """
        if self._digest is None:
            self._digest = self._joined_digest()
        return self._digest

    def _joined_digest(self) -> str:
        records = self._records
        if not records:
            raise ValueError("a generation cut needs at least one staged record")
        first, last = records[0], records[-1]
        if len(records) == 1:
            return first.digest
        count = self.token_count
        check_lineage(
            first.parent_call_id, first.mode, first.prev_len, count, first.prev_len + count
        )
        call = self._call
        if call.identity is None:
            call.identity = _call_identity(
                first.rollout_id, first.model_call_id, first.parent_call_id, first.mode
            )
        digest = hashlib.sha256(call.identity)
        digest.update(_u64s(first.prev_len, count, first.prev_len + count, first.weight_version))
        pairs = [columns.masks_and_log_probs() for columns in self._columns]
        for width, parts in (
            (_U64_BYTES, [columns.tokens() for columns in self._columns]),
            (_F32_BYTES, [masks for masks, _ in pairs]),
            (_F32_BYTES, [log_probs for _, log_probs in pairs]),
        ):
            # A block's byte length, then the block: its element count and its elements.
            digest.update(_PACK_U64(_U64_BYTES + width * count) + _PACK_U64(count))
            for part in parts:
                digest.update(part)
        # The records' digests were checked when they were built or read: no pattern match here.
        digest.update(
            _call_tail_of(
                _EMPTY_EXTRAS, bytes.fromhex(last.chain_hash), bytes.fromhex(last.cumulative_hash)
            )
        )
        return digest.hexdigest()

    def chunk_hashes(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """The chain and cumulative hashes of the staged tokens followed by ``token_ids``: the
        hashes of the next chunk, ``compute_chain_hash(parent_chain_hash, staged + token_ids)``
        and ``hash_token_ids(parent tokens + staged + token_ids)``.

        Raises:
            ValueError: A token id is out of range.
        """
        parts = [columns.tokens() for columns in self._columns]
        parts.append(encode_token_elements(token_ids))
        count = self.token_count + len(token_ids)
        chain = hashlib.sha256(self._call.chain_head + _PACK_U64(count))
        cumulative = hashlib.sha256(
            CUMULATIVE_HASH_DOMAIN + _PACK_U64(self.parent_token_count + count)
        )
        if self._call.token_ids:
            cumulative.update(self._call.elements())
        for part in parts:
            chain.update(part)
            cumulative.update(part)
        return chain.hexdigest(), cumulative.hexdigest()
