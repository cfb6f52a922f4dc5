"""The reference deployment's tokenizer, chat rendering and generation function.

A token is a byte (ids 0-255) and text is Latin-1, so encoding and decoding round-trip exactly.
Every message renders as ``\\x02 role \\x03 content \\x04`` and a prompt ends with the generation
prompt ``\\x02assistant\\x03``; since an assistant message's content is exactly the decoded
completion, the prompt of call k+1 starts with the prompt of call k plus its completion.

Output token *i* of a call is a pure function of (seed, prompt, *i*), drawn from
:data:`OUTPUT_ALPHABET`. That is what lets the drill prove exactly-once token for token: a
generation cut at *k* tokens and continued from position *k* yields exactly the uninterrupted
tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

OUTPUT_ALPHABET: Final = tuple(b"abcdefghijklmnopqrstuvwxyz0123456789 ")
"""The only token ids the worker generates: lowercase letters, digits and space."""

CHAT_ROLES: Final = ("system", "user", "assistant", "tool")
GENERATION_PROMPT: Final = "\x02assistant\x03"
_SEED_LIMIT: Final = 2**64
_POSITION_LIMIT: Final = 2**32


def encode(text: str) -> list[int]:
    """The token ids of ``text``: its Latin-1 bytes.

    Raises:
        UnicodeEncodeError: ``text`` holds a character outside Latin-1.
    """
    return list(text.encode("latin-1"))


def decode(token_ids: Iterable[int]) -> str:
    """The text of some token ids.

    Raises:
        ValueError: An id is outside 0-255.
    """
    return bytes(token_ids).decode("latin-1")


def render_message(role: str, content: str) -> str:
    """One message as the model sees it.

    Raises:
        ValueError: The role is unknown, or the content holds a framing byte.
    """
    if role not in CHAT_ROLES:
        raise ValueError(f"unknown chat role {role!r}; expected one of {CHAT_ROLES}")
    if any(marker in content for marker in "\x02\x03\x04"):
        raise ValueError("message content may not hold the framing bytes 0x02, 0x03 or 0x04")
    return f"\x02{role}\x03{content}\x04"


def render_prompt(messages: Iterable[Mapping[str, str]]) -> str:
    """The prompt of a call: every message so far, then the generation prompt."""
    rendered = "".join(render_message(m["role"], m["content"]) for m in messages)
    return rendered + GENERATION_PROMPT


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
