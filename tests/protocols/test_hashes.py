"""Golden vectors pin every staging hash byte for byte; layouts are rebuilt here by hand."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols import compute_chain_hash, hash_token_ids, root_call_hashes
from protocols._extras_digest import EMPTY_EXTRAS_DIGEST, compute_extras_digest
from protocols._hashes import compute_staging_digest, encode_token_ids
from tests.staging_factories import GOLDEN_EXTRAS, golden_record

GOLDEN_DIGEST = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"
GOLDEN_EXTRAS_DIGEST = "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
EMPTY_DIGEST = "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _u64(value: int) -> bytes:
    return struct.pack(">Q", value)


def _text(value: str) -> bytes:
    return _u64(len(value.encode())) + value.encode()


def test_the_reference_golden_vector_reproduces() -> None:
    record = golden_record()
    assert record.extras_digest == GOLDEN_EXTRAS_DIGEST
    assert record.digest == GOLDEN_DIGEST


def test_the_staging_digest_layout_byte_for_byte() -> None:
    def block(body: bytes, count: int) -> bytes:
        inner = _u64(count) + body
        return _u64(len(inner)) + inner  # double prefix: byte length, then element count

    payload = (
        b"nemo-gym-staging-call-v2"
        + bytes([2, 2, 1])
        + _text("rollout-1")
        + _text("call-1")
        + b"\x01"
        + _text("parent-1")
        + _text("token_in")
        + _u64(3)
        + _u64(2)
        + _u64(5)
        + _u64(7)
        + block(_u64(10) + _u64(11), 2)
        + block(struct.pack(">ff", 0.0, 1.0), 2)
        + block(struct.pack(">ff", 0.0, -0.25), 2)
        + bytes.fromhex(GOLDEN_EXTRAS_DIGEST)
        + b"\x01"
        + bytes.fromhex("11" * 32)
        + b"\x01"
        + bytes.fromhex("22" * 32)
    )
    assert _sha(payload) == GOLDEN_DIGEST


def test_a_root_encodes_its_missing_parent_as_one_zero_byte() -> None:
    record = golden_record(parent_call_id=None, mode="text", prev_len=0)
    fields = record.model_dump(exclude={"digest", "extras"})
    rebuilt = compute_staging_digest(**fields)
    assert rebuilt == record.digest != GOLDEN_DIGEST


def test_the_extras_digest_golden_and_empty() -> None:
    assert compute_extras_digest(GOLDEN_EXTRAS) == GOLDEN_EXTRAS_DIGEST
    assert compute_extras_digest(None) == EMPTY_EXTRAS_DIGEST == EMPTY_DIGEST
    assert _sha(b"nemo-gym-staging-extras-v1" + b"\x01" + b"N") == EMPTY_DIGEST


def test_the_extras_encoding_of_every_type() -> None:
    value = {"b": [None, True, False, -3, 0.5, "é"], "a": {}}
    encoded = (
        b"D"
        + _u64(2)
        + _text("a")
        + b"D"
        + _u64(0)
        + _text("b")
        + b"L"
        + _u64(6)
        + b"N"
        + b"B\x01"
        + b"B\x00"
        + b"I"
        + struct.pack(">q", -3)
        + b"F"
        + struct.pack(">d", 0.5)
        + b"S"
        + _text("é")
    )
    assert compute_extras_digest(value) == _sha(b"nemo-gym-staging-extras-v1\x01" + encoded)


def test_extras_keys_sort_by_utf8_bytes() -> None:
    # "é" (0xC3 0xA9) sorts after "z" by UTF-8 bytes; insertion order must not matter.
    assert compute_extras_digest({"é": 1, "z": 2}) == compute_extras_digest({"z": 2, "é": 1})
    encoded = b"D" + _u64(2) + _text("z") + b"I" + _u64(2) + _text("é") + b"I" + _u64(1)
    assert compute_extras_digest({"é": 1, "z": 2}) == _sha(
        b"nemo-gym-staging-extras-v1\x01" + encoded
    )


@pytest.mark.parametrize(
    ("extras", "error"),
    [
        ({"x": (1, 2)}, TypeError),
        ({"x": b"raw"}, TypeError),
        ({1: 2}, TypeError),
        ({"x": math.nan}, ValueError),
        ({"x": 2**63}, ValueError),
        ([1, 2], TypeError),
    ],
)
def test_extras_refuse_what_runtimes_could_encode_differently(
    extras: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        compute_extras_digest(extras)  # type: ignore[arg-type]


def test_the_cumulative_hash_layout() -> None:
    assert encode_token_ids([10, 11]) == _u64(2) + _u64(10) + _u64(11)
    assert hash_token_ids([10, 11]) == _sha(
        b"nemo-gym-staging-prefix-v2" + _u64(2) + _u64(10) + _u64(11)
    )
    assert hash_token_ids([]) == _sha(b"nemo-gym-staging-prefix-v2" + _u64(0))
    assert (
        hash_token_ids([1, 2]) == "84a16cc398b4ae27ec099417ac60388905246558670c64015a95ec040e3b77c3"
    )


def test_the_chain_hash_layout_and_chaining() -> None:
    root = compute_chain_hash(None, [1, 2])
    assert root == _sha(b"nemo-gym-staging-chain-v1" + b"\x00" + _u64(2) + _u64(1) + _u64(2))
    child = compute_chain_hash(root, [3])
    assert child == _sha(
        b"nemo-gym-staging-chain-v1" + b"\x01" + bytes.fromhex(root) + _u64(1) + _u64(3)
    )
    assert root == "7d366462877e834250d2ac253e45fb02926e705f4fce8e7b70054d90f800e804"


@pytest.mark.parametrize("bad", ["", "AB" * 32, "1" * 63, "g" * 64])
def test_the_chain_hash_refuses_a_malformed_parent(bad: str) -> None:
    with pytest.raises(ValueError, match="parent_chain_hash"):
        compute_chain_hash(bad, [1])


@pytest.mark.parametrize("token", [-1, 2**64, True, 1.0])
def test_token_ids_must_be_u64_ints(token: object) -> None:
    with pytest.raises(ValueError, match="token id"):
        encode_token_ids([token])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_mask_delta": [0.0, 1]}, "finite floats"),
        ({"generation_log_probs_delta": [0.0, 1e39]}, "float32"),
        ({"generation_log_probs_delta": [0.0, math.inf]}, "finite floats"),
        ({"generation_log_probs_delta": [0.0, math.nan]}, "finite floats"),
        ({"generation_log_probs_delta": [0.0, -math.inf]}, "finite floats"),
        ({"token_mask_delta": [0.5, 1.0]}, "0.0 or 1.0"),
        ({"generation_log_probs_delta": [-1.0, 0.0]}, "log-prob 0.0"),
        ({"parent_call_id": ""}, "non-empty"),
        ({"parent_call_id": None}, "root"),
        ({"mode": "text"}, "child"),
        (
            {"token_ids_delta": [], "token_mask_delta": [], "generation_log_probs_delta": []},
            "at least one",
        ),
        ({"token_mask_delta": [1.0]}, "equal lengths"),
        ({"rollout_id": ""}, "non-empty"),
    ],
)
def test_the_staging_digest_checks_every_rule(changes: dict[str, object], message: str) -> None:
    fields = golden_record().model_dump(exclude={"digest", "extras"})
    fields.update(changes)
    fields["delta_len"] = len(fields["token_ids_delta"])  # type: ignore[arg-type]
    fields["cum_len"] = fields["prev_len"] + fields["delta_len"]  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        compute_staging_digest(**fields)  # type: ignore[arg-type]


def test_float32_extremes_are_accepted_and_hashed_as_float32() -> None:
    # The finiteness check reads the input, not the packed block (D351): values at float32's edge
    # pass, and one that rounds to its largest value is packed as that value.
    edge = -3.4028234663852886e38  # float32's largest magnitude, exactly
    over = -3.4028235e38  # a float64 just past it that rounds to it
    fields = golden_record().model_dump(exclude={"digest", "extras"})
    fields.update(
        token_ids_delta=[10, 11, 12, 13],
        token_mask_delta=[0.0, 1.0, 1.0, 1.0],
        generation_log_probs_delta=[0.0, edge, over, -1e-45],
        delta_len=4,
        cum_len=7,
    )
    digest = compute_staging_digest(**fields)
    assert digest == compute_staging_digest(
        **{**fields, "generation_log_probs_delta": [0.0, edge, edge, -1e-45]}
    )


def test_the_staging_digest_checks_lengths_and_versions() -> None:
    fields = golden_record().model_dump(exclude={"digest", "extras"})
    with pytest.raises(ValueError, match="delta_len"):
        compute_staging_digest(**{**fields, "delta_len": 3, "cum_len": 6})
    with pytest.raises(ValueError, match="cum_len"):
        compute_staging_digest(**{**fields, "cum_len": 6})
    with pytest.raises(ValueError, match="versions"):
        compute_staging_digest(**{**fields, "digest_version": 1})


@given(st.lists(st.integers(0, 2**64 - 1), max_size=40))
def test_a_root_call_s_two_hashes_from_one_encoding_are_the_two_hashes(tokens: list[int]) -> None:
    """D418: ``root_call_hashes`` gives exactly what the two functions give on their own."""
    assert root_call_hashes(tokens) == (compute_chain_hash(None, tokens), hash_token_ids(tokens))


def test_a_root_call_s_hashes_refuse_what_the_encoding_refuses() -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        root_call_hashes([1, -1])
