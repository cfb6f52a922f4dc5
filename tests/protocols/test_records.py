"""The records-line and manifest byte formats, the layout and the task digest."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import PurePosixPath
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols import (
    build_manifest,
    decode_json,
    decode_record_line,
    encode_record_line,
    is_records_file_name,
    participant_directory,
    serialize_manifest,
    task_digest,
)
from protocols._records import records_file_name

DIGEST = "ef2d127de37b942baad06145e54b0c619a1f22327b2ebbcfbec78f5564afe39d"


def test_a_line_is_default_json_dumps_with_ascii_escapes_and_key_order_kept() -> None:
    record = {"z": 1, "a": [1.5, None, True], "text": "héllo", "big": 2**80}
    assert encode_record_line(record) == (
        b'{"z": 1, "a": [1.5, null, true], "text": "h\\u00e9llo", '
        b'"big": 1208925819614629174706176}\n'
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_on_write(value: float) -> None:
    with pytest.raises(ValueError):
        encode_record_line({"x": value})


def test_a_record_that_contains_itself_or_nests_too_deeply_is_refused_as_a_value_error() -> None:
    # D443: the encoder keeps no table of the containers it is in; the recursion limit stops a
    # cycle instead, and the writer still gets the ValueError it turns into a typed refusal.
    looped: dict[str, Any] = {"a": [1]}
    looped["self"] = looped
    deep: list[Any] = []
    inner = deep
    for _ in range(sys.getrecursionlimit() + 10):
        inner.append([])
        inner = inner[0]
    for record in (looped, {"x": deep}):
        with pytest.raises(ValueError, match="nested too deeply, or contains itself"):
            encode_record_line(record)


def test_non_finite_numbers_are_accepted_on_read() -> None:
    record = decode_record_line(b'{"x": NaN, "y": Infinity, "z": -Infinity}\n')
    assert math.isnan(record["x"]) and record["y"] == math.inf and record["z"] == -math.inf


@pytest.mark.parametrize("line", [b"[1, 2]\n", b"3\n", b'"s"\n', b"{broken\n"])
def test_a_line_must_be_a_json_object(line: bytes) -> None:
    with pytest.raises(ValueError):
        decode_record_line(line)


def test_decoding_keeps_key_order() -> None:
    assert list(decode_record_line(b'{"b": 1, "a": 2, "c": 3}')) == ["b", "a", "c"]


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()  # NaN and both infinities too: a records line may hold them on read
    | st.text(st.characters(exclude_categories=())),  # lone surrogates too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON_VALUES, st.booleans())
def test_decode_json_gives_what_json_loads_gives(value: object, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    # ``repr`` tells an int from a float, -0.0 from 0.0, and matches NaN with NaN.
    assert repr(decode_json(text)) == repr(json.loads(text))
    assert repr(decode_json(text.encode("utf-8", "surrogatepass"))) == repr(json.loads(text))


@given(_JSON_VALUES, st.integers(min_value=0), st.binary(max_size=3))
def test_decode_json_refuses_what_json_loads_refuses(value: object, at: int, junk: bytes) -> None:
    data = json.dumps(value).encode()
    at %= len(data) + 1
    damaged = data[:at] + junk + data[at + len(junk) :]
    try:
        expected = repr(json.loads(damaged))
    except ValueError:
        with pytest.raises(ValueError):
            decode_json(damaged)
    else:
        assert repr(decode_json(damaged)) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('"\\ud800"', "\ud800"),  # pydantic-core refuses a lone surrogate escape
        ("[" * 300 + "]" * 300, json.loads("[" * 300 + "]" * 300)),  # and nesting past 200
        ('{"a": 1, "b": 2, "a": 3}', {"a": 3, "b": 2}),
    ],
)
def test_decode_json_falls_back_to_json_where_pydantic_core_refuses(
    text: str, value: object
) -> None:
    assert decode_json(text) == value
    assert decode_json(text.encode()) == value


def test_manifest_bytes_are_pinned() -> None:
    manifest = build_manifest(
        kind="model",
        instance="policy",
        checkpoint_id="ckpt-7",
        records_sha256=DIGEST,
        record_count=2,
        extra={"staging_keys": ["s1"], "note": "é"},
    )
    expected = (
        "{\n"
        ' "checkpoint_id": "ckpt-7",\n'
        ' "instance": "policy",\n'
        ' "kind": "model",\n'
        ' "note": "\\u00e9",\n'
        ' "record_count": 2,\n'
        f' "records_file": "records-{DIGEST}.jsonl",\n'
        f' "records_sha256": "{DIGEST}",\n'
        ' "schema_version": 1,\n'
        ' "staging_keys": [\n'
        '  "s1"\n'
        " ]\n"
        "}"
    )
    assert serialize_manifest(manifest) == expected.encode()


def test_extras_may_not_shadow_core_fields() -> None:
    with pytest.raises(ValueError, match="shadow"):
        build_manifest(
            kind="model",
            instance="policy",
            checkpoint_id="c",
            records_sha256=DIGEST,
            record_count=0,
            extra={"record_count": 5},
        )


def test_records_file_names() -> None:
    assert records_file_name(DIGEST) == f"records-{DIGEST}.jsonl"
    assert is_records_file_name(f"records-{DIGEST}.jsonl")
    assert is_records_file_name("records.jsonl")
    for bad in [
        "../records.jsonl",
        "records-abc.jsonl",
        "manifest.json",
        f"x/records-{DIGEST}.jsonl",
    ]:
        assert not is_records_file_name(bad)
    with pytest.raises(ValueError):
        records_file_name("ABC")


def test_participant_directory() -> None:
    root = PurePosixPath("/c")
    assert participant_directory(root, "model", "policy") == PurePosixPath("/c/gym/model/policy")
    for kind, instance in [("model", "../x"), ("model", ""), ("judge", "x"), ("agent", "a/b")]:
        with pytest.raises(ValueError):
            participant_directory(root, kind, instance)


def test_task_digest_is_sha256_of_canonical_json() -> None:
    task = {
        "task_input": {"turns": 2, "activations": 2},
        "task_id": {"taskset": "counter", "task_id": "r"},
    }
    canonical = (
        '{"task_id":{"task_id":"r","taskset":"counter"},"task_input":{"activations":2,"turns":2}}'
    )
    assert task_digest(task) == hashlib.sha256(canonical.encode()).hexdigest()
    assert (
        task_digest({"k": "é"})
        == hashlib.sha256(json.dumps({"k": "é"}).replace(" ", "").encode()).hexdigest()
    )
