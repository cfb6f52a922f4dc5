"""Publication: the controller's aggregate manifest, written last, then the ``LATEST`` pointer.

Layout under a run root::

    <root>/checkpoints/<id>/gym/<kind>/<instance>/...   each participant's commit
    <root>/checkpoints/<id>/checkpoint.json             this aggregate manifest, written last
    <root>/checkpoints/LATEST                           the id of the newest published checkpoint

A checkpoint exists once its ``checkpoint.json`` does; ``LATEST`` only ever names such a
checkpoint, because it is replaced after ``checkpoint.json`` is durable. Every write is temp file,
fsync, rename, directory fsync.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

import anyio
from pydantic import BaseModel, ConfigDict, JsonValue

from protocols import (
    MANIFEST_FILE,
    PUBLISH_SPAN,
    CommitReply,
    EpisodeId,
    InvalidCheckpointStateError,
    ParticipantKind,
    participant_directory,
    validate_checkpoint_id,
)

from ._members import Member
from ._tracing import coordinator_span

CHECKPOINTS_SUBDIR: Final = "checkpoints"
CHECKPOINT_FILE: Final = "checkpoint.json"
LATEST_FILE: Final = "LATEST"
PUBLISH_FAULTS: Final = frozenset({"latest-before-manifest"})
"""Test-only faults of publication; ``latest-before-manifest`` moves ``LATEST`` first (wrong)."""


class PublishedParticipant(BaseModel):
    """One participant's share of a published checkpoint.

    Attributes:
        kind: The participant kind.
        instance: Its server name.
        url: Where it was served when it committed.
        manifest: Path of its ``manifest.json``, relative to the checkpoint directory.
        manifest_sha256: SHA-256 of the manifest file's bytes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ParticipantKind
    instance: str
    url: str
    manifest: str
    manifest_sha256: str


class CheckpointManifest(BaseModel):
    """``checkpoint.json``: the whole checkpoint as the controller published it.

    Attributes:
        checkpoint_id: The checkpoint's id (also its directory name).
        created_at: Unix time of publication.
        participants: Every participant's committed share.
        continued: The commit scope: the episodes a restore continues.
        staging_keys_by_episode: Capture key → staging keys (from the model's commit reply).
        controller_state: The controller's own state, opaque JSON, restored with the rest.
        traceparent: The W3C trace context of the checkpoint's trace, when it was traced: a
            restore's trace links to it (absent from the file otherwise).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_id: str
    created_at: float
    participants: list[PublishedParticipant]
    continued: list[EpisodeId]
    staging_keys_by_episode: dict[str, list[str]]
    controller_state: JsonValue
    traceparent: str | None = None


def checkpoint_directory(root: Path, checkpoint_id: str) -> Path:
    """``<root>/checkpoints/<id>``: the ``checkpoint_dir`` to commit into.

    Raises:
        ValueError: The id is not a safe path component.
    """
    return Path(root) / CHECKPOINTS_SUBDIR / validate_checkpoint_id(checkpoint_id)


def _no_boundary(_boundary: str) -> None:
    return None


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_durably(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes reach the disk before any name points at them
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # the rename itself survives a power loss only after this


def publish_checkpoint_sync(
    root: Path,
    checkpoint_id: str,
    members: Sequence[Member],
    commits: Mapping[str, CommitReply],
    continued: Sequence[EpisodeId],
    controller_state: JsonValue,
    *,
    fault: str | None = None,
    on_boundary: Callable[[str], None] | None = None,
    traceparent: str | None = None,
) -> CheckpointManifest:
    """Blocking body of :func:`publish_checkpoint` (call it from a worker thread).

    Raises:
        InvalidCheckpointStateError: A member has no commit reply, its manifest is missing, or
            the manifest on disk is not the one its commit reply announced.
        ValueError: An unknown fault.
    """
    if fault is not None and fault not in PUBLISH_FAULTS:
        raise ValueError(f"unknown publication fault {fault!r}; known: {sorted(PUBLISH_FAULTS)}")
    directory = checkpoint_directory(root, checkpoint_id)
    published: list[PublishedParticipant] = []
    staging: dict[str, list[str]] = {}
    for member in members:
        reply = commits.get(member.instance)
        if reply is None:
            raise InvalidCheckpointStateError(f"{member.instance} has no commit reply")
        relative = participant_directory(Path("."), member.kind, member.instance) / MANIFEST_FILE
        try:
            data = (directory / relative).read_bytes()
        except OSError as exc:
            raise InvalidCheckpointStateError(f"{member.instance}: {exc}") from exc
        on_disk = json.loads(data)
        if on_disk != reply.manifest.model_dump(mode="json"):
            raise InvalidCheckpointStateError(
                f"{member.instance}: the manifest on disk is not the one its commit announced"
            )
        published.append(
            PublishedParticipant(
                kind=member.kind,
                instance=member.instance,
                url=member.url,
                manifest=str(relative),
                manifest_sha256=hashlib.sha256(data).hexdigest(),
            )
        )
        extras = reply.model_extra or {}
        for key, keys in (extras.get("staging_keys_by_episode") or {}).items():
            staging[key] = sorted(set(staging.get(key, [])) | set(keys))
    manifest = CheckpointManifest(
        checkpoint_id=checkpoint_id,
        created_at=time.time(),
        participants=published,
        continued=list(continued),
        staging_keys_by_episode=dict(sorted(staging.items())),
        controller_state=controller_state,
        traceparent=traceparent,
    )
    directory.mkdir(parents=True, exist_ok=True)
    _fsync_directory(directory.parent)  # the checkpoint's own directory entry must survive too
    fields = manifest.model_dump(mode="json")
    if fields["traceparent"] is None:
        del fields["traceparent"]  # an untraced checkpoint's file is what it always was
    body = json.dumps(fields, sort_keys=True, indent=1).encode()
    if fault == "latest-before-manifest":
        # Deliberately wrong, for the proof suite: a crash now leaves LATEST on a partial commit.
        _replace_durably(directory.parent / LATEST_FILE, checkpoint_id.encode())
    boundary = on_boundary or _no_boundary
    boundary("manifests-published")  # every share verified on disk, no checkpoint.json yet
    _replace_durably(directory / CHECKPOINT_FILE, body)
    boundary("checkpoint-json-written")  # checkpoint.json durable, LATEST not moved yet
    # Only now may LATEST name it: a pointer never leads to a checkpoint without its manifest.
    _replace_durably(directory.parent / LATEST_FILE, checkpoint_id.encode())
    return manifest


async def publish_checkpoint(
    root: Path,
    checkpoint_id: str,
    members: Sequence[Member],
    commits: Mapping[str, CommitReply],
    continued: Sequence[EpisodeId],
    controller_state: JsonValue = None,
    *,
    fault: str | None = None,
    on_boundary: Callable[[str], None] | None = None,
    traceparent: str | None = None,
) -> CheckpointManifest:
    """Publish a committed checkpoint: ``checkpoint.json`` last, then ``LATEST``.

    Call it only after every participant's commit succeeded, and before resume.

    Args:
        root: The run root.
        checkpoint_id: The checkpoint's id.
        members: Every participant that committed.
        commits: Server name → its commit reply.
        continued: The commit scope.
        controller_state: The controller's own state (any JSON).
        fault: A test-only fault from ``PUBLISH_FAULTS`` (never set it in production).
        on_boundary: Called, in the worker thread, with ``manifests-published`` before
            ``checkpoint.json`` is written and ``checkpoint-json-written`` before ``LATEST``
            moves (a test harness kills the controller there); nothing by default.
        traceparent: The checkpoint trace's context, stored in ``checkpoint.json``.

    Raises:
        InvalidCheckpointStateError: A participant's manifest is missing or not the committed one.
        ValueError: An unknown fault.
    """
    with coordinator_span(PUBLISH_SPAN, id=checkpoint_id, rollouts=len(continued)):
        return await anyio.to_thread.run_sync(
            functools.partial(
                publish_checkpoint_sync,
                root,
                checkpoint_id,
                members,
                commits,
                continued,
                controller_state,
                fault=fault,
                on_boundary=on_boundary,
                traceparent=traceparent,
            )
        )


def read_checkpoint(root: Path, checkpoint_id: str) -> CheckpointManifest:
    """Read and check ``checkpoint.json`` of one checkpoint (blocking).

    Raises:
        InvalidCheckpointStateError: Missing, corrupt, of another id, or a participant's manifest
            does not match its recorded digest.
    """
    directory = checkpoint_directory(root, checkpoint_id)
    try:
        manifest = CheckpointManifest.model_validate_json(
            (directory / CHECKPOINT_FILE).read_bytes()
        )
    except (OSError, ValueError) as exc:
        raise InvalidCheckpointStateError(f"checkpoint {checkpoint_id}: {exc}") from exc
    if manifest.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointStateError(
            f"{directory / CHECKPOINT_FILE} names checkpoint {manifest.checkpoint_id!r}"
        )
    for share in manifest.participants:
        try:
            digest = hashlib.sha256((directory / share.manifest).read_bytes()).hexdigest()
        except OSError as exc:
            raise InvalidCheckpointStateError(f"checkpoint {checkpoint_id}: {exc}") from exc
        if digest != share.manifest_sha256:
            raise InvalidCheckpointStateError(
                f"checkpoint {checkpoint_id}: the manifest of {share.instance} changed"
            )
    return manifest


def read_latest(root: Path) -> CheckpointManifest | None:
    """The newest published checkpoint, or ``None`` when nothing was published (blocking).

    Raises:
        InvalidCheckpointStateError: ``LATEST`` names a checkpoint that does not read back.
    """
    pointer = Path(root) / CHECKPOINTS_SUBDIR / LATEST_FILE
    try:
        checkpoint_id = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    try:
        validate_checkpoint_id(checkpoint_id)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"{pointer}: {exc}") from exc
    return read_checkpoint(root, checkpoint_id)
