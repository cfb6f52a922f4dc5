"""The reference deployment's tokenizer and chat rendering.

A token is a byte (ids 0-255) and text is Latin-1, so encoding and decoding round-trip exactly.
Every message renders as ``\\x02 role \\x03 content \\x04`` and a prompt ends with the generation
prompt ``\\x02assistant\\x03``; since an assistant message's content is exactly the decoded
completion, the prompt of call k+1 starts with the prompt of call k plus its completion.

The deterministic generation function of the reference worker lives with it
(``e2e._worker.generation``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

CHAT_ROLES: Final = ("system", "user", "assistant", "tool")
GENERATION_PROMPT: Final = "\x02assistant\x03"


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
