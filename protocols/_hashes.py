"""The staging hash functions, byte for byte.

Four digests bind staged token data to the token-free capture ledger:

- the **cumulative hash** of an exact token sequence (``hash_token_ids``);
- the **chain hash** of a call's delta on top of its parent's chain hash (``compute_chain_hash``),
  so ``chain_N = H(chain_{N-1} || delta_N)`` proves continuity without materializing tokens;
- the **extras digest** of a call's optional extras (``compute_extras_digest``, in
  ``protocols._extras_digest``), a typed binary encoding rather than JSON so that runtimes cannot
  disagree;
- the **staging digest v2** of a whole staged call (``compute_staging_digest``).

Layouts (every length is a u64 big-endian *byte* count unless it says elements):

- token block: u64 element count, then each id as u64 big-endian;
- float block: u64 element count, then each value as float32 big-endian;
- text: u64 length + UTF-8; optional text: ``0x00`` or ``0x01`` + text;
- staging digest: domain, bytes (schema 2, digest 2, extras 1), rollout id, model call id, optional
  parent, mode; u64 prev_len, delta_len, cum_len, weight_version; each of the token, mask and
  log-prob blocks prefixed by its own u64 byte length; the 32 raw extras-digest bytes;
  ``0x01`` + 32 bytes chain hash; ``0x01`` + 32 bytes cumulative hash.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Final

from ._layout import check_staged_layout
from ._records import is_sha256_hex
from ._strict import (
    EXACT_FLOAT_TYPES,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
)

CALL_DIGEST_DOMAIN: Final = b"nemo-gym-staging-call-v2"
CUMULATIVE_HASH_DOMAIN: Final = b"nemo-gym-staging-prefix-v2"
CHAIN_HASH_DOMAIN: Final = b"nemo-gym-staging-chain-v1"
_CALL_DIGEST_HEAD: Final = CALL_DIGEST_DOMAIN + bytes(
    (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
)
"""The digest's domain and version bytes: a call passes only these versions."""
_ROOT_CHAIN_HEAD: Final = CHAIN_HASH_DOMAIN + b"\x00"

_U64_MAX: Final = 2**64 - 1
_EXACT_INT: Final = frozenset({int})
# The checks below run per token on every staged record. Each first tries the whole column at C
# speed (the set of its element types; one struct call) and only on a failure walks it item by
# item, so the item that broke the rule is named exactly as before.


def _u64(value: int, *, field: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise ValueError(f"{field} must be an unsigned 64-bit integer, got {value!r}")
    return struct.pack(">Q", value)


_PACK_U64: Final = struct.Struct(">Q").pack
_PACK_2U64: Final = struct.Struct(">2Q").pack
_PACK_4U64: Final = struct.Struct(">4Q").pack
_COUNT_BYTES: Final = 8
"""A token or float block's leading u64 element count."""
_LENGTH_FIELDS: Final = ("prev_len", "delta_len", "cum_len", "weight_version")


def _u64s(prev_len: int, delta_len: int, cum_len: int, weight_version: int) -> bytes:
    """The four u64 fields of the staging digest in one pack; a bad one is named by ``_u64``."""
    values = (prev_len, delta_len, cum_len, weight_version)
    if _EXACT_INT.issuperset(map(type, values)):
        try:
            return _PACK_4U64(*values)
        except struct.error:
            pass  # out of range: named below
    return b"".join(_u64(v, field=f) for v, f in zip(values, _LENGTH_FIELDS, strict=True))


def _text(value: str, *, field: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be text, got {type(value).__name__}")
    data = value.encode("utf-8")
    return struct.pack(">Q", len(data)) + data


def _digest_bytes(value: str, *, field: str) -> bytes:
    if not is_sha256_hex(value):
        raise ValueError(f"{field} must be a lowercase SHA-256 hex digest")
    return bytes.fromhex(value)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """The token block: u64 element count, then each id as u64 big-endian.

    Raises:
        ValueError: An id is not an exact integer in ``[0, 2**64)``.
    """
    return _PACK_U64(len(token_ids)) + encode_token_elements(token_ids)


def encode_token_elements(token_ids: Sequence[int]) -> bytes:
    """Each id as u64 big-endian: the token block without its leading count.

    Raises:
        ValueError: An id is not an exact integer in ``[0, 2**64)``.
    """
    if _EXACT_INT.issuperset(map(type, token_ids)):
        try:
            return struct.pack(f">{len(token_ids)}Q", *token_ids)
        except struct.error:
            pass  # out of range: named below
    _refuse_bad_ids(token_ids)
    return struct.pack(f">{len(token_ids)}Q", *token_ids)


def _refuse_bad_ids(token_ids: Sequence[int]) -> None:
    for token_id in token_ids:
        if type(token_id) is not int or not 0 <= token_id <= _U64_MAX:
            raise ValueError(f"a token id must be an unsigned 64-bit integer, got {token_id!r}")


def encode_float32_elements(values: Sequence[float], *, field: str) -> bytes:
    """Each value as float32 big-endian: a float block without its leading count.

    Raises:
        ValueError: A value is not an exact finite float that float32 can hold (``field`` names
            the column in the message).
    """
    if EXACT_FLOAT_TYPES.issuperset(map(type, values)):
        try:
            block = struct.pack(f">{len(values)}f", *values)
        except OverflowError:
            pass  # named below
        else:
            # Packing refuses a finite value that float32 would round to an infinity, so the
            # block holds an infinity or a NaN only where the input does. And the sum of values
            # within float32's range cannot overflow a float64: it is finite exactly when every
            # value is. No need to read the block back (D351).
            if math.isfinite(sum(values)):
                return block
    return _checked_float32s(values, field=field)


def _checked_float32s(values: Sequence[float], *, field: str) -> bytes:
    """The values packed, or the ``ValueError`` naming the first that cannot be."""
    for value in values:
        if type(value) is not float or not math.isfinite(value):
            raise ValueError(f"{field} must hold finite floats, got {value!r}")
    try:
        packed = struct.pack(f">{len(values)}f", *values)
    except (OverflowError, struct.error) as exc:
        raise ValueError(f"{field} holds a value float32 cannot represent") from exc
    if not all(map(math.isfinite, struct.unpack(f">{len(values)}f", packed))):
        raise ValueError(f"{field} holds a value that overflows float32")
    return packed


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """The cumulative hash of one exact token sequence (SHA-256 hex)."""
    return hashlib.sha256(CUMULATIVE_HASH_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """The chain hash of a delta on top of its parent's chain hash; a root chains from ``None``.

    Raises:
        ValueError: The parent is not a digest or a token id is out of range.
    """
    return hashlib.sha256(
        _chain_head(parent_chain_hash) + encode_token_ids(token_ids_delta)
    ).hexdigest()


def _chain_head(parent_chain_hash: str | None) -> bytes:
    """A chain hash's bytes before its token block: the domain, then ``0x00`` for a root or
    ``0x01`` and the parent's 32 bytes (``ValueError`` when the parent is not a digest)."""
    if parent_chain_hash is None:
        return _ROOT_CHAIN_HEAD
    return CHAIN_HASH_DOMAIN + b"\x01" + _digest_bytes(parent_chain_hash, field="parent_chain_hash")


def root_call_hashes(token_ids: Sequence[int]) -> tuple[str, str]:
    """``(compute_chain_hash(None, token_ids), hash_token_ids(token_ids))`` from one encoding.

    A root call's delta is its whole sequence, so both hashes cover the same token block; at
    thousands of tokens the encoding is most of either hash's cost (D418).

    Raises:
        ValueError: A token id is out of range.
    """
    block = encode_token_ids(token_ids)
    chain = hashlib.sha256(_ROOT_CHAIN_HEAD + block).hexdigest()
    return chain, hashlib.sha256(CUMULATIVE_HASH_DOMAIN + block).hexdigest()


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """The staging digest v2 of one staged call, after checking every structural rule.

    Raises:
        ValueError: A version is unsupported, a rule of :func:`check_staged_layout` is broken, an
            identifier is empty, or a value cannot be encoded.
    """
    return _staging_digest_blocks(
        schema_version=schema_version,
        digest_version=digest_version,
        extras_digest_version=extras_digest_version,
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=cum_len,
        weight_version=weight_version,
        token_ids_delta=token_ids_delta,
        token_mask_delta=token_mask_delta,
        generation_log_probs_delta=generation_log_probs_delta,
        extras_digest=extras_digest,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
    )[0]


def _staging_digest_blocks(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
    token_elements: bytes | None = None,
) -> tuple[str, bytes, bytes, bytes]:
    """``compute_staging_digest``, and the token, mask and log-prob elements it hashed (each
    column's block without its leading count; D423).

    ``token_elements``, when given, must be ``encode_token_elements(token_ids_delta)`` of the
    same list (its ids were checked as it was made): the token block is then not encoded again.
    """
    versions = (schema_version, digest_version, extras_digest_version)
    expected = (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
    if any(type(v) is not int for v in versions) or versions != expected:
        raise ValueError(f"unsupported staging versions {versions}; this code speaks {expected}")
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    check_staged_layout(
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=cum_len,
        token_ids_delta=token_ids_delta,
        token_mask_delta=token_mask_delta,
        generation_log_probs_delta=generation_log_probs_delta,
    )
    tokens = encode_token_elements(token_ids_delta) if token_elements is None else token_elements
    masks = encode_float32_elements(token_mask_delta, field="token_mask_delta")
    log_probs = encode_float32_elements(
        generation_log_probs_delta, field="generation_log_probs_delta"
    )
    count = delta_len  # check_staged_layout: every column holds delta_len elements
    floats_head = _PACK_2U64(_COUNT_BYTES + 4 * count, count)
    # One buffer hashed once: the bytes an update per part would feed, for less Python a call.
    # Each block is double-prefixed: its byte length, then its element count and its elements.
    digest = hashlib.sha256(
        b"".join(
            (
                _call_identity(rollout_id, model_call_id, parent_call_id, mode),
                _u64s(prev_len, delta_len, cum_len, weight_version),
                _PACK_2U64(_COUNT_BYTES + 8 * count, count),
                tokens,
                floats_head,
                masks,
                floats_head,
                log_probs,
                _call_tail(extras_digest, chain_hash, cumulative_hash),
            )
        )
    ).hexdigest()
    return digest, tokens, masks, log_probs


def _call_identity(
    rollout_id: str, model_call_id: str, parent_call_id: str | None, mode: str
) -> bytes:
    """The staging digest's bytes before the four lengths: domain, versions, the call."""
    parent = b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id, field="parent")
    return (
        _CALL_DIGEST_HEAD
        + _text(rollout_id, field="rollout_id")
        + _text(model_call_id, field="model_call_id")
        + parent
        + _text(mode, field="mode")
    )


def _call_tail(extras_digest: str, chain_hash: str, cumulative_hash: str) -> bytes:
    """The staging digest's bytes after the three column blocks (``ValueError`` when a value is
    not a lowercase SHA-256 hex digest)."""
    return _call_tail_of(
        _digest_bytes(extras_digest, field="extras_digest"),
        _digest_bytes(chain_hash, field="chain_hash"),
        _digest_bytes(cumulative_hash, field="cumulative_hash"),
    )


def _call_tail_of(extras_digest: bytes, chain_hash: bytes, cumulative_hash: bytes) -> bytes:
    """``_call_tail`` of three raw digests."""
    return extras_digest + b"\x01" + chain_hash + b"\x01" + cumulative_hash
