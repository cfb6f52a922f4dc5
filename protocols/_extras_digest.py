"""The extras digest: a typed binary encoding of a call's optional extras, then SHA-256.

A typed encoding rather than JSON, so that runtimes cannot disagree on spacing, key order or
number spelling. Layout: domain, version byte 1, then the value: ``N`` (none), ``B`` + one byte,
``I`` + i64, ``F`` + f64 (finite), ``S`` + text, ``L`` + u64 count + items, ``D`` + u64 count +
(text key, value) pairs sorted by the keys' UTF-8 bytes. Exact types only.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Any, Final

from ._hashes import _text
from ._strict import EXTRAS_DIGEST_VERSION

EXTRAS_DIGEST_DOMAIN: Final = b"nemo-gym-staging-extras-v1"


def _encode_extra(value: Any) -> bytes:
    # Exact types only: a numpy scalar, a tuple or bytes must not silently pick an encoding.
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B\x01" if value else b"B\x00"
    if type(value) is int:
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"an extras integer is outside the signed 64-bit range: {value}")
        return b"I" + struct.pack(">q", value)
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"extras floats must be finite, got {value!r}")
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        return b"S" + _text(value, field="extras text")
    if type(value) is list:
        return b"L" + struct.pack(">Q", len(value)) + b"".join(map(_encode_extra, value))
    if type(value) is dict:
        if any(type(key) is not str for key in value):
            raise TypeError("extras mappings must have string keys")
        keys = sorted(value, key=lambda key: key.encode("utf-8"))
        return (
            b"D"
            + struct.pack(">Q", len(keys))
            + b"".join(_text(key, field="extras key") + _encode_extra(value[key]) for key in keys)
        )
    raise TypeError(f"extras cannot hold a {type(value).__name__}")


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """The extras digest: domain, version byte 1, then the typed encoding of the mapping or ``None``.

    Raises:
        TypeError: A value has a type the encoding does not support.
        ValueError: An integer leaves the i64 range or a float is not finite.
    """
    if extras is not None and not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    normalized = None if extras is None else dict(extras)
    payload = bytes([EXTRAS_DIGEST_VERSION]) + _encode_extra(normalized)
    return hashlib.sha256(EXTRAS_DIGEST_DOMAIN + payload).hexdigest()


EMPTY_EXTRAS_DIGEST: Final = compute_extras_digest(None)
"""The extras digest of a call without extras."""
