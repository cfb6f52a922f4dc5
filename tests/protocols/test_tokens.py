"""The tokenizer, chat rendering and the generation function of e2e-contract §2."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from e2e._worker.generation import OUTPUT_ALPHABET, generate_token, generate_tokens
from protocols import decode, encode, render_prompt
from protocols._tokens import GENERATION_PROMPT, render_message

latin1 = st.text(alphabet=st.characters(max_codepoint=255))


@given(latin1)
def test_encode_and_decode_round_trip(text: str) -> None:
    assert decode(encode(text)) == text
    assert all(0 <= t <= 255 for t in encode(text))


def test_the_output_alphabet() -> None:
    assert bytes(OUTPUT_ALPHABET) == b"abcdefghijklmnopqrstuvwxyz0123456789 "
    assert len(OUTPUT_ALPHABET) == 37


def test_rendering() -> None:
    assert render_message("user", "hi") == "\x02user\x03hi\x04"
    messages = [{"role": "system", "content": "counter"}, {"role": "user", "content": "r1 0"}]
    assert (
        render_prompt(messages)
        == "\x02system\x03counter\x04\x02user\x03r1 0\x04" + GENERATION_PROMPT
    )
    with pytest.raises(ValueError, match="role"):
        render_message("robot", "x")
    with pytest.raises(ValueError, match="framing"):
        render_message("user", "a\x04b")


@given(st.lists(st.sampled_from(["user", "tool"]), min_size=1, max_size=3), st.integers(0, 2**32))
def test_the_next_prompt_extends_the_previous_prompt_and_completion(
    roles: list[str], seed: int
) -> None:
    messages = [{"role": "system", "content": "counter"}]
    prompt = encode(render_prompt(messages))
    for role in roles:
        completion = decode(generate_tokens(seed, prompt, 0, 8))
        messages += [{"role": "assistant", "content": completion}, {"role": role, "content": "x"}]
        following = encode(render_prompt(messages))
        assert following[: len(prompt) + 8] == prompt + encode(completion)
        prompt = following


def test_generate_token_is_the_contract_formula() -> None:
    prompt = encode("\x02user\x03hi\x04\x02assistant\x03")
    material = (7).to_bytes(8, "big") + bytes(prompt) + (3).to_bytes(4, "big")
    draw = int.from_bytes(hashlib.sha256(material).digest()[:8], "big")
    assert generate_token(7, prompt, 3) == OUTPUT_ALPHABET[draw % 37]
    assert decode(generate_tokens(0, prompt, 0, 10)) == "mkfta1c30a"


@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 255), max_size=20), st.integers(0, 40))
def test_a_cut_and_continued_generation_is_the_uninterrupted_one(
    seed: int, prompt: list[int], cut: int
) -> None:
    whole = generate_tokens(seed, prompt, 0, 40)
    assert generate_tokens(seed, prompt, 0, cut) + generate_tokens(seed, prompt, cut, 40) == whole
    assert all(token in OUTPUT_ALPHABET for token in whole)


@pytest.mark.parametrize(("seed", "position"), [(-1, 0), (2**64, 0), (0, -1), (0, 2**32)])
def test_generation_arguments_are_bounded(seed: int, position: int) -> None:
    with pytest.raises(ValueError, match="fit"):
        generate_token(seed, [1], position)
