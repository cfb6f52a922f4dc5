"""The checkpoint storage format: records lines, participant manifests, digests, the layout.

A participant's share of a checkpoint is one records file (one JSON object per line) and one
``manifest.json`` that names the file by its SHA-256 and counts its lines. These functions are
the pure half of that format; the writer and reader that touch disk live in ``participants``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import from_json

from ._ids import InstanceName, validate_safe_name
from ._phases import PARTICIPANT_KINDS, ParticipantKind

MANIFEST_SCHEMA_VERSION: Final = 1
MANIFEST_FILE: Final = "manifest.json"
RECORDS_FILE_PATTERN: Final = r"^records(-[0-9a-f]{64})?\.jsonl$"
"""Records file names a reader accepts; ``records.jsonl`` is the name older checkpoints used."""
_RECORDS_FILE = re.compile(RECORDS_FILE_PATTERN)
SHA256_HEX_PATTERN: Final = r"^[0-9a-f]{64}$"
_SHA256_HEX = re.compile(SHA256_HEX_PATTERN)
MANIFEST_CORE_FIELDS: Final = frozenset(
    {
        "schema_version",
        "kind",
        "instance",
        "checkpoint_id",
        "records_file",
        "records_sha256",
        "record_count",
    }
)
PARTICIPANTS_SUBDIR: Final = "gym"


class ParticipantManifest(BaseModel):
    """The ``manifest.json`` of one participant's share of a checkpoint.

    Participant extras (for example the model's staging keys) ride alongside the core fields and
    may not shadow them.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    schema_version: Literal[1]
    kind: ParticipantKind
    instance: InstanceName
    checkpoint_id: str
    records_file: str = Field(pattern=RECORDS_FILE_PATTERN)
    records_sha256: str = Field(pattern=SHA256_HEX_PATTERN)
    record_count: int = Field(ge=0)


def is_sha256_hex(value: object) -> bool:
    """Whether ``value`` is a lowercase SHA-256 hex digest (``SHA256_HEX_PATTERN``)."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def records_file_name(records_sha256: str) -> str:
    """The published name of a records file with this digest."""
    if not is_sha256_hex(records_sha256):
        raise ValueError(f"not a SHA-256 hex digest: {records_sha256!r}")
    return f"records-{records_sha256}.jsonl"


def is_records_file_name(name: str) -> bool:
    """Whether a manifest may name this file (guards against paths leaving the directory)."""
    return _RECORDS_FILE.fullmatch(name) is not None


_RECORD_ENCODER: Final = json.JSONEncoder(allow_nan=False, check_circular=False)
"""``json.dumps`` with a non-default option builds a new encoder per call; a commit of thousands
of records encodes them with this one. It keeps no table of the containers it is inside, which
cost a tenth of the encoding (D443): a record that contains itself recurses until Python's
limit instead, and :func:`encode_record_line` refuses it as ``ValueError`` all the same."""


def encode_record_line(record: Mapping[str, Any]) -> bytes:
    """One records-file line: default ``json.dumps`` spacing, non-ASCII escaped, then ``\\n``.

    Key order is kept as given, because restored state is often re-rendered to a model.

    Raises:
        ValueError: The record holds a non-finite number or something that is not JSON, or is
            nested deeper than Python's recursion limit (a record that contains itself is).
        TypeError: The record holds a value JSON cannot encode.
    """
    try:
        return _RECORD_ENCODER.encode(record).encode("ascii") + b"\n"
    except RecursionError:
        raise ValueError("the record is nested too deeply, or contains itself") from None


def decode_json(data: str | bytes) -> Any:
    """The value of ``json.loads(data)``, parsed by pydantic-core's parser where it can be.

    pydantic-core parses the JSON this project writes two to three times faster than ``json``
    (D356). Where it refuses text ``json`` accepts (a lone surrogate escape such as ``"\\ud800"``,
    nesting deeper than its limit of 200, UTF-16 input) or refuses at all, ``json.loads`` parses
    the text again, so the value, or the error, is always the one ``json.loads`` gives.

    Only keys go through pydantic-core's string cache: they repeat from record to record, while
    values (ids, digests, text) mostly do not, and looking each one up cost more than it saved.
    A restore's records parse a quarter to a third faster so (D433).

    Raises:
        ValueError: ``data`` is not JSON (``json.JSONDecodeError`` or ``UnicodeDecodeError``).
    """
    try:
        return from_json(data, cache_strings="keys")
    except ValueError:
        return json.loads(data)


def decode_record_line(line: bytes) -> dict[str, Any]:
    """Parse one records-file line. ``NaN`` and ``Infinity`` are accepted on read.

    Raises:
        ValueError: The line is not a JSON object.
    """
    value = decode_json(line)
    if not isinstance(value, dict):
        raise ValueError(f"a record must be a JSON object, got {type(value).__name__}")
    return value


def build_manifest(
    *,
    kind: ParticipantKind,
    instance: str,
    checkpoint_id: str,
    records_sha256: str,
    record_count: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest object for a records file, participant extras merged after the core fields.

    Raises:
        ValueError: An extra would shadow a core field, or a name is unsafe.
    """
    if kind not in PARTICIPANT_KINDS:
        raise ValueError(f"unknown participant kind {kind!r}")
    validate_safe_name(instance, what="instance")
    manifest: dict[str, Any] = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": records_file_name(records_sha256),
        "records_sha256": records_sha256,
        "record_count": record_count,
    }
    shadowed = MANIFEST_CORE_FIELDS.intersection(extra or {})
    if shadowed:
        raise ValueError(f"participant extras may not shadow core fields: {sorted(shadowed)}")
    manifest.update(extra or {})
    return manifest


def serialize_manifest(manifest: Mapping[str, Any]) -> bytes:
    """The exact bytes of ``manifest.json``: sorted keys, indent 1, ASCII, no trailing newline."""
    return json.dumps(
        manifest, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def participant_directory(checkpoint_dir: PurePath, kind: str, instance: str) -> PurePath:
    """``<checkpoint>/gym/<kind>/<instance>``: where one participant's share lives.

    Raises:
        ValueError: The kind is unknown or the instance is not a safe path component.
    """
    if kind not in PARTICIPANT_KINDS:
        raise ValueError(f"unknown participant kind {kind!r}")
    validate_safe_name(instance, what="instance")
    return checkpoint_dir / PARTICIPANTS_SUBDIR / kind / instance


def task_digest(task: Any) -> str:
    """SHA-256 hex of a task as canonical JSON: sorted keys, compact separators, ASCII."""
    canonical = json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
