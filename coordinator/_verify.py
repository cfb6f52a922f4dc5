"""Verification: re-read one published checkpoint end to end, in its directory or on S3.

:func:`verify_checkpoint` reads ``checkpoint.json``, each participant manifest against its recorded
SHA-256, each records file against its manifest's digest and line count, all through the
checkpoint's ``CheckpointStore``, and names every problem with the path or ``s3://`` URL of the
object concerned. Blocking work: call it from a worker thread inside an event loop.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

from protocols import (
    CheckpointStore,
    ParticipantManifest,
    is_object_store_url,
    is_records_file_name,
    open_store,
    store_key,
)

from ._layout import CHECKPOINT_FILE
from ._publish import CheckpointManifest, PublishedParticipant


def _sha256_of(store: CheckpointStore, key: str) -> tuple[str, int]:
    """SHA-256 and line count of an object, streamed."""
    digest = hashlib.sha256()
    lines = 0
    for line in store.lines(key):
        digest.update(line)
        lines += 1
    return digest.hexdigest(), lines


def _verify_share(
    store: CheckpointStore, manifest: CheckpointManifest, share: PublishedParticipant
) -> list[str]:
    """The problems of one participant's share: its manifest, then its records."""
    try:
        manifest_key = store_key(share.manifest)
    except ValueError as exc:
        return [
            f"{store.describe(CHECKPOINT_FILE)}: unsafe manifest path of {share.instance} ({exc})"
        ]
    where = store.describe(manifest_key)
    try:
        data = store.read(manifest_key)
    except OSError as exc:
        return [f"{where}: missing manifest of {share.instance} ({exc})"]
    actual = hashlib.sha256(data).hexdigest()
    if actual != share.manifest_sha256:
        return [f"{where}: sha256 {actual} but checkpoint.json records {share.manifest_sha256}"]
    try:
        participant = ParticipantManifest.model_validate(json.loads(data))
    except ValueError as exc:
        return [f"{where}: not a participant manifest ({exc})"]
    problems: list[str] = []
    if (participant.kind, participant.instance) != (share.kind, share.instance):
        problems.append(
            f"{where}: belongs to {participant.kind}/{participant.instance}, "
            f"checkpoint.json lists {share.kind}/{share.instance}"
        )
    if participant.checkpoint_id != manifest.checkpoint_id:
        problems.append(
            f"{where}: names checkpoint {participant.checkpoint_id!r}, "
            f"expected {manifest.checkpoint_id!r}"
        )
    if not is_records_file_name(participant.records_file):
        problems.append(f"{where}: unsafe records file {participant.records_file!r}")
        return problems
    records_key = str(PurePosixPath(manifest_key).parent / participant.records_file)
    records = store.describe(records_key)
    try:
        digest, count = _sha256_of(store, records_key)
    except OSError as exc:
        problems.append(f"{records}: missing records file ({exc})")
        return problems
    if digest != participant.records_sha256:
        problems.append(
            f"{records}: sha256 {digest} but its manifest records {participant.records_sha256}"
        )
    if count != participant.record_count:
        problems.append(
            f"{records}: {count} records but its manifest records {participant.record_count}"
        )
    return problems


def verify_checkpoint(location: str | Path) -> list[str]:
    """Every way a published checkpoint differs from what it claims (empty when it is intact).

    Args:
        location: ``<root>/checkpoints/<id>``: a directory, or the checkpoint's
            ``s3://bucket/prefix/checkpoints/<id>`` URL.

    Returns:
        One precise message per problem found, naming the file (or ``s3://`` object) concerned.
        A checkpoint without ``checkpoint.json`` (a partial commit) is one problem.

    Raises:
        ValueError: A malformed ``s3://`` URL.
    """
    store = open_store(location if is_object_store_url(location) else Path(location))
    name = PurePosixPath(store.url).name
    path = store.describe(CHECKPOINT_FILE)
    try:
        manifest = CheckpointManifest.model_validate_json(store.read(CHECKPOINT_FILE))
    except (OSError, ValueError) as exc:
        return [f"{path}: unreadable checkpoint.json ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    if manifest.checkpoint_id != name:
        problems.append(
            f"{path}: names checkpoint {manifest.checkpoint_id!r}, directory is {name!r}"
        )
    for share in manifest.participants:
        problems += _verify_share(store, manifest, share)
    return problems
