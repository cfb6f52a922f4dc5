"""Publication: the controller's aggregate manifest, written last, then the ``LATEST`` pointer.

Layout under a run root, a directory or ``s3://bucket/prefix`` (see ``_layout``)::

    <root>/checkpoints/<id>/gym/<kind>/<instance>/...   each participant's commit
    <root>/checkpoints/<id>/checkpoint.json             this aggregate manifest, written last
    <root>/checkpoints/LATEST                           the id of the newest published checkpoint

A checkpoint exists once its ``checkpoint.json`` does; ``LATEST`` only ever names such a
checkpoint, because it is replaced after ``checkpoint.json`` is durable. Every write goes through
the run root's ``CheckpointStore``: ``checkpoint.json`` is created once (a hard link, or a put with
``If-None-Match: *``) and ``LATEST`` is replaced only if it is still the version read before
``checkpoint.json`` was written (``flock`` and rename, or ``If-Match``), so of two publishers
racing on one root exactly one moves it (D332).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

import anyio
from pydantic import BaseModel, ConfigDict, JsonValue

from protocols import (
    MANIFEST_FILE,
    PUBLISH_SPAN,
    CheckpointStore,
    CommitReply,
    EpisodeId,
    InvalidCheckpointStateError,
    ParticipantKind,
    open_store,
    participant_directory,
    validate_checkpoint_id,
)

from ._layout import (
    CHECKPOINT_FILE,
    LATEST_KEY,
    CheckpointTakenError,
    LatestMovedError,
    checkpoint_key,
    latest_id,
)
from ._members import Member
from ._tracing import coordinator_span

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


def _no_boundary(_boundary: str) -> None:
    return None


def _verified_shares(
    store: CheckpointStore,
    checkpoint_id: str,
    members: Sequence[Member],
    commits: Mapping[str, CommitReply],
) -> tuple[list[PublishedParticipant], dict[str, list[str]]]:
    """Every member's share, its manifest read back from the store and checked against its reply."""
    published: list[PublishedParticipant] = []
    staging: dict[str, list[str]] = {}
    for member in members:
        reply = commits.get(member.instance)
        if reply is None:
            raise InvalidCheckpointStateError(f"{member.instance} has no commit reply")
        relative = participant_directory(Path("."), member.kind, member.instance) / MANIFEST_FILE
        try:
            data = store.read(checkpoint_key(checkpoint_id, relative.as_posix()))
        except OSError as exc:
            raise InvalidCheckpointStateError(f"{member.instance}: {exc}") from exc
        if json.loads(data) != reply.manifest.model_dump(mode="json"):
            raise InvalidCheckpointStateError(
                f"{member.instance}: the manifest in the store is not the one its commit announced"
            )
        published.append(
            PublishedParticipant(
                kind=member.kind,
                instance=member.instance,
                url=member.url,
                manifest=relative.as_posix(),
                manifest_sha256=hashlib.sha256(data).hexdigest(),
            )
        )
        extras = reply.model_extra or {}
        for key, keys in (extras.get("staging_keys_by_episode") or {}).items():
            staging[key] = sorted(set(staging.get(key, [])) | set(keys))
    return published, staging


def _encoded(manifest: CheckpointManifest) -> bytes:
    fields = manifest.model_dump(mode="json")
    if fields["traceparent"] is None:
        del fields["traceparent"]  # an untraced checkpoint's file is what it always was
    return json.dumps(fields, sort_keys=True, indent=1).encode()


def _same_publication(a: CheckpointManifest, b: CheckpointManifest) -> bool:
    """Whether two manifests publish the same commit: same shares (by digest) and same scope."""

    def shares(m: CheckpointManifest) -> set[tuple[str, str, str, str]]:
        return {(p.kind, p.instance, p.manifest, p.manifest_sha256) for p in m.participants}

    return (
        a.checkpoint_id == b.checkpoint_id
        and shares(a) == shares(b)
        and sorted(e.capture_key for e in a.continued) == sorted(e.capture_key for e in b.continued)
    )


def _create_checkpoint_json(
    store: CheckpointStore, manifest: CheckpointManifest
) -> CheckpointManifest:
    """Create ``checkpoint.json`` once; a retry of the same publication finds its own and keeps it.

    Raises:
        CheckpointTakenError: The id already holds another publication.
    """
    key = checkpoint_key(manifest.checkpoint_id, CHECKPOINT_FILE)
    if store.create(key, _encoded(manifest)):
        return manifest
    data = store.read(key)
    try:
        existing = CheckpointManifest.model_validate_json(data)
    except ValueError:
        existing = None
    if existing is not None and _same_publication(existing, manifest):
        return existing  # an earlier try of this publication got this far: it stands as written
    raise CheckpointTakenError(
        f"{store.describe(key)} already holds another publication of checkpoint "
        f"{manifest.checkpoint_id!r} (other shares or scope); nothing was written: publish "
        "under a fresh checkpoint id",
        checkpoint_id=manifest.checkpoint_id,
        location=store.describe(key),
    )


def _move_latest(store: CheckpointStore, checkpoint_id: str, version: str | None) -> None:
    """Point ``LATEST`` at the checkpoint, only if nobody moved it since ``version`` was read.

    Raises:
        LatestMovedError: Another publisher moved it first.
    """
    if store.replace_if(LATEST_KEY, checkpoint_id.encode(), version):
        return
    now = latest_id(store)
    if now == checkpoint_id:
        return  # a twin try of this very publication moved it: the same end state
    location = store.describe(checkpoint_key(checkpoint_id, CHECKPOINT_FILE))
    raise LatestMovedError(
        f"checkpoint {checkpoint_id!r} is published ({location}) but LATEST was not moved to it: "
        f"another publisher moved {store.describe(LATEST_KEY)} after this one read it (it names "
        f"{now!r} now); one controller per run root publishes",
        checkpoint_id=checkpoint_id,
        location=location,
        latest=now,
    )


def publish_checkpoint_sync(
    root: str | Path,
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
            the manifest in the store is not the one its commit reply announced.
        CheckpointTakenError: The id's ``checkpoint.json`` holds another publication.
        LatestMovedError: Another publisher moved ``LATEST`` first (this one stays published).
        ValueError: An unknown fault, an unsafe id or a malformed ``s3://`` root.
        OSError: The store failed (``protocols.StoreError``).
    """
    if fault is not None and fault not in PUBLISH_FAULTS:
        raise ValueError(f"unknown publication fault {fault!r}; known: {sorted(PUBLISH_FAULTS)}")
    validate_checkpoint_id(checkpoint_id)
    store = open_store(root)
    published, staging = _verified_shares(store, checkpoint_id, members, commits)
    manifest = CheckpointManifest(
        checkpoint_id=checkpoint_id,
        created_at=time.time(),
        participants=published,
        continued=list(continued),
        staging_keys_by_episode=dict(sorted(staging.items())),
        controller_state=controller_state,
        traceparent=traceparent,
    )
    if fault == "latest-before-manifest":
        # Deliberately wrong, for the proof suite: a crash now leaves LATEST on a partial commit.
        store.replace(LATEST_KEY, checkpoint_id.encode())
    boundary = on_boundary or _no_boundary
    boundary("manifests-published")  # every share verified in the store, no checkpoint.json yet
    before = store.read_versioned(LATEST_KEY)  # LATEST moves only from what it is now
    manifest = _create_checkpoint_json(store, manifest)
    boundary("checkpoint-json-written")  # checkpoint.json durable, LATEST not moved yet
    # Only now may LATEST name it: a pointer never leads to a checkpoint without its manifest.
    _move_latest(store, checkpoint_id, None if before is None else before[1])
    return manifest


async def publish_checkpoint(
    root: str | Path,
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

    Call it only after every participant's commit succeeded, and before resume. Publishing the
    same commit again (a retry after a crash) is idempotent: the ``checkpoint.json`` already there
    stands, and ``LATEST`` is moved to it.

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.
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

    Returns:
        The published manifest (on a retry, the one already in the store).

    Raises:
        InvalidCheckpointStateError: A participant's manifest is missing or not the committed one.
        CheckpointTakenError: The id's ``checkpoint.json`` holds another publication; nothing
            was written.
        LatestMovedError: Another publisher moved ``LATEST`` between this one's read of it and
            its update: ``checkpoint.json`` stays published, ``LATEST`` is the other's.
        ValueError: An unknown fault, an unsafe id or a malformed ``s3://`` root.
        OSError: The store failed (``protocols.StoreError``).
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


def read_checkpoint(root: str | Path, checkpoint_id: str) -> CheckpointManifest:
    """Read and check ``checkpoint.json`` of one checkpoint (blocking).

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.
        checkpoint_id: The checkpoint's id.

    Raises:
        InvalidCheckpointStateError: Missing (a partial commit), corrupt, of another id, or a
            participant's manifest does not match its recorded digest.
        ValueError: A malformed ``s3://`` root.
    """
    try:
        key = checkpoint_key(checkpoint_id, CHECKPOINT_FILE)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"checkpoint {checkpoint_id[:200]!r}: {exc}") from exc
    store = open_store(root)
    try:
        manifest = CheckpointManifest.model_validate_json(store.read(key))
    except (OSError, ValueError) as exc:
        raise InvalidCheckpointStateError(f"checkpoint {checkpoint_id}: {exc}") from exc
    if manifest.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointStateError(
            f"{store.describe(key)} names checkpoint {manifest.checkpoint_id!r}"
        )
    for share in manifest.participants:
        try:
            data = store.read(checkpoint_key(checkpoint_id, share.manifest))
        except (OSError, ValueError) as exc:
            raise InvalidCheckpointStateError(f"checkpoint {checkpoint_id}: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != share.manifest_sha256:
            raise InvalidCheckpointStateError(
                f"checkpoint {checkpoint_id}: the manifest of {share.instance} changed"
            )
    return manifest


def read_latest(root: str | Path) -> CheckpointManifest | None:
    """The newest published checkpoint, or ``None`` when nothing was published (blocking).

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.

    Raises:
        InvalidCheckpointStateError: ``LATEST`` names a checkpoint that does not read back.
        ValueError: A malformed ``s3://`` root.
    """
    store = open_store(root)
    try:
        data = store.read(LATEST_KEY)
    except FileNotFoundError:  # protocols.ObjectMissingError too
        return None
    try:
        checkpoint_id = data.decode("utf-8").strip()
        validate_checkpoint_id(checkpoint_id)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"{store.describe(LATEST_KEY)}: {exc}") from exc
    return read_checkpoint(root, checkpoint_id)
