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

from ._extras_digest import EMPTY_EXTRAS_DIGEST
from ._hashes import (
    _PACK_U64,
    CUMULATIVE_HASH_DOMAIN,
    _call_identity,
    _call_tail_of,
    _chain_head,
    _u64s,
    encode_float32_elements,
    encode_token_elements,
)
from ._layout import check_lineage
from ._staging import CaptureMode, EncodedColumns, StagedCallRecord

_EMPTY_EXTRAS: Final = bytes.fromhex(EMPTY_EXTRAS_DIGEST)
_U64_BYTES: Final = 8
_F32_BYTES: Final = 4


class _Columns:
    """One record's columns, encoded on first use and then shared by every prefix holding it."""

    __slots__ = ("_log_probs", "_masks", "_record", "_tokens")

    def __init__(self, record: StagedCallRecord, encoded: EncodedColumns | None = None) -> None:
        self._record = record
        self._tokens: bytes | None = None
        self._masks: bytes | None = None
        self._log_probs: bytes | None = None
        if encoded is not None:
            count = record.delta_len
            if (len(encoded.tokens), len(encoded.masks), len(encoded.log_probs)) != (
                _U64_BYTES * count,
                _F32_BYTES * count,
                _F32_BYTES * count,
            ):
                raise ValueError("the encoded columns do not hold the record's delta")
            self._tokens, self._masks, self._log_probs = encoded

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

    def extended(
        self, record: StagedCallRecord, columns: EncodedColumns | None = None
    ) -> StagedPrefix:
        """This prefix followed by ``record``, which must continue it: the same call, only
        generated tokens (a chunk), no extras, a policy version not older than the last.

        Args:
            record: The next record.
            columns: The record's columns as its digest encoded them
                (:meth:`StagedCallRecord.encoded_from_components`); encoded when first needed
                if left out.

        Raises:
            ValueError: ``record`` does not continue this prefix, or ``columns`` do not hold
                its delta.
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
        longer._columns = (*self._columns, _Columns(record, columns))
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

    def next_record(
        self,
        *,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        mode: CaptureMode,
        prev_len: int,
        weight_version: int,
        token_ids: Sequence[int],
        token_masks: Sequence[float],
        log_probs: Sequence[float],
    ) -> StagedPrefix:
        """This prefix extended by the call's next record, built from its columns: the first
        record of a call when the prefix is empty, else a chunk.

        The record's chain and cumulative hashes are those through it (:meth:`chunk_hashes`,
        which on an empty prefix are the call's own: its delta on its parent), and its digest,
        its hashes and every later digest of the prefix share one encoding of each column (D423).
        The new record is ``records[-1]`` of the answer.

        Raises:
            ValueError: A column cannot be encoded, the record breaks a staging rule, or it does
                not continue this prefix (:meth:`extended`).
        """
        elements = encode_token_elements(token_ids)
        chain_hash, cumulative_hash = self._hashes_through(elements)
        record, columns = StagedCallRecord.encoded_from_components(
            rollout_id=rollout_id,
            model_call_id=model_call_id,
            parent_call_id=parent_call_id,
            mode=mode,
            prev_len=prev_len,
            weight_version=weight_version,
            token_ids_delta=token_ids,
            token_mask_delta=token_masks,
            generation_log_probs_delta=log_probs,
            chain_hash=chain_hash,
            cumulative_hash=cumulative_hash,
            token_elements=elements,
        )
        return self.extended(record, columns)

    def chunk_hashes(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """The chain and cumulative hashes of the staged tokens followed by ``token_ids``: the
        hashes of the next chunk, ``compute_chain_hash(parent_chain_hash, staged + token_ids)``
        and ``hash_token_ids(parent tokens + staged + token_ids)``.

        Raises:
            ValueError: A token id is out of range.
        """
        return self._hashes_through(encode_token_elements(token_ids))

    def _hashes_through(self, elements: bytes) -> tuple[str, str]:
        """``chunk_hashes`` of tokens whose elements are already encoded."""
        columns = self._columns
        tokens = b"".join([*(c.tokens() for c in columns), elements]) if columns else elements
        count = len(tokens) // _U64_BYTES
        call = self._call
        parent = call.elements() if call.token_ids else b""
        chain = hashlib.sha256(b"".join((call.chain_head, _PACK_U64(count), tokens)))
        cumulative = hashlib.sha256(
            b"".join(
                (CUMULATIVE_HASH_DOMAIN, _PACK_U64(len(call.token_ids) + count), parent, tokens)
            )
        )
        return chain.hexdigest(), cumulative.hexdigest()
