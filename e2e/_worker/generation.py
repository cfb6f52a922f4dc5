"""The reference worker's generation function: output token *i* is a pure function of its inputs.

Output token *i* of a call is a function of (seed, prompt, *i*) alone, drawn from
:data:`OUTPUT_ALPHABET`. That is what lets the drill prove exactly-once token for token: a
generation cut at *k* tokens and continued from position *k* yields exactly the tokens of an
uninterrupted call. This is the reference workload, not part of the wire contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

OUTPUT_ALPHABET: Final = tuple(b"abcdefghijklmnopqrstuvwxyz0123456789 ")
"""The only token ids the worker generates: lowercase letters, digits and space."""

_SEED_LIMIT: Final = 2**64
_POSITION_LIMIT: Final = 2**32


def generate_token(seed: int, prompt_ids: Sequence[int], position: int) -> int:
    """Output token ``position`` of a call with this prompt and seed.

    ``OUTPUT_ALPHABET[int.from_bytes(sha256(seed ‖ prompt ‖ position)[:8]) % 37]`` with the seed as
    8 bytes and the position as 4 bytes, both big-endian.

    Raises:
        ValueError: The seed or position is out of range, or a prompt id is not a byte.
    """
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must fit in 8 unsigned bytes, got {seed}")
    if not 0 <= position < _POSITION_LIMIT:
        raise ValueError(f"position must fit in 4 unsigned bytes, got {position}")
    material = seed.to_bytes(8, "big") + bytes(prompt_ids) + position.to_bytes(4, "big")
    draw = int.from_bytes(hashlib.sha256(material).digest()[:8], "big")
    return OUTPUT_ALPHABET[draw % len(OUTPUT_ALPHABET)]


def generate_tokens(seed: int, prompt_ids: Sequence[int], start: int, stop: int) -> list[int]:
    """Output tokens ``start`` up to ``stop`` (exclusive): what an uninterrupted call returns."""
    prompt = bytes(prompt_ids)  # checks every id is a byte, once
    return [generate_token(seed, prompt, position) for position in range(start, stop)]
