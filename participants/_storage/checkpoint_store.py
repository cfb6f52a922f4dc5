"""Writing and reading one participant's share of a checkpoint, on a directory or on S3.

Layout: ``<checkpoint>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and ``manifest.json``. The
share's location is a directory path or the same as an ``s3://`` URL; every read and write goes
through the checkpoint store it names (``open_store``). The manifest is published last, exactly
once, by the store's ``create`` (a hard link on a directory, a put with ``If-None-Match: *`` on
S3: neither replaces an existing manifest), so a share with a manifest never changes and one
without is a partial commit that readers ignore.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeAlias

from pydantic import ValidationError

from protocols import (
    MANIFEST_FILE,
    MANIFEST_SPAN,
    WRITE_SPAN,
    CheckpointStore,
    InvalidCheckpointStateError,
    ObjectMissingError,
    ParticipantKind,
    ParticipantManifest,
    build_manifest,
    decode_record_line,
    encode_record_line,
    is_object_store_url,
    is_records_file_name,
    open_store,
    serialize_manifest,
)

from .._tracing import checkpoint_span, set_checkpoint_attributes

RECORDS_CHUNK_BYTES: Final = 1 << 20
"""Records are encoded line by line but written and hashed about this many bytes at a time."""

WRITE_STEPS: Final = (
    "records_temp_created",
    "records_streamed",
    "records_synced",
    "records_renamed",
    "manifest_temp_synced",
    "manifest_linked",
    "published",
)
"""Named points of a write, in order; a test hook can stop at each to prove crash safety.

The same on both stores: ``records_renamed`` once the records have their name (renamed, or the
object put), ``manifest_temp_synced`` just before the manifest is created, ``manifest_linked``
once it is (linked, or put)."""

ShareLocation: TypeAlias = Path | str
"""A participant's share: a directory, or the same as an ``s3://bucket/…`` URL."""


def open_share(location: ShareLocation) -> CheckpointStore:
    """The checkpoint store rooted at one share; keys are the file names in it.

    Raises:
        InvalidCheckpointStateError: The location is a malformed ``s3://`` URL, or S3 support
            (the ``s3`` extra) is not installed.
    """
    try:
        return open_store(location)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"cannot open the share {location}: {exc}") from exc


def _write_chunk(handle: BinaryIO, hasher: Any, pending: list[bytes]) -> None:
    """Write and hash the pending lines as one chunk, and empty the list.

    A chunk at a time, not a line at a time: each write and each large hash update lets go of
    the GIL, and taking it back waits behind a busy event loop (D345).
    """
    chunk = b"".join(pending)
    handle.write(chunk)
    hasher.update(chunk)
    pending.clear()


class RecordsWriter:
    """Publishes one participant's records and manifest for one checkpoint.

    ``write`` blocks (run it in a worker thread); ``stop`` may be called from any thread. Once
    ``stop`` returns, this writer never publishes: it waits only for a publication already under
    way.

    Args:
        location: The participant's share, ``<checkpoint>/gym/<kind>/<instance>``: a directory,
            or the same as an ``s3://`` URL.
        kind: The participant kind written into the manifest.
        instance: The participant instance written into the manifest.
        checkpoint_id: The checkpoint this share belongs to.
        on_step: Called with each name of ``WRITE_STEPS`` as the write reaches it (tests only).
    """

    def __init__(
        self,
        location: ShareLocation,
        *,
        kind: ParticipantKind,
        instance: str,
        checkpoint_id: str,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.location: ShareLocation = location if is_object_store_url(location) else Path(location)
        self.kind: ParticipantKind = kind
        self.instance = instance
        self.checkpoint_id = checkpoint_id
        self._on_step = on_step
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.bytes_written = 0
        """The size of the records file, once written."""

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` was called."""
        return self._stopped

    def stop(self) -> None:
        """Forbid publication from now on; waits for a publication already under way."""
        with self._stop_lock:
            self._stopped = True

    def write(
        self, records: Iterable[Mapping[str, Any]], *, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Stream the records into the store and publish the manifest.

        Returns:
            The published manifest. If the share already holds an identical manifest (a repeat
            of the same commit), that manifest.

        Raises:
            InvalidCheckpointStateError: The writer was stopped, a record cannot be stored, the
                share already holds a different commit, or I/O (the disk, the network) failed.
                Nothing is published.
        """
        try:
            return self._write(open_share(self.location), records, extra)
        except InvalidCheckpointStateError:
            raise
        except OSError as exc:  # a StoreError too: a failed request, credentials, a timeout
            raise InvalidCheckpointStateError(
                f"I/O error writing {self.location}: {exc.strerror or exc}"
            ) from exc

    def _write(
        self,
        store: CheckpointStore,
        records: Iterable[Mapping[str, Any]],
        extra: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        self._raise_if_stopped()
        # A directory spools in the share itself (the rename stays on one file system); S3 in a
        # local temporary directory, uploaded from there.
        fd, temp_name = tempfile.mkstemp(prefix=".records.jsonl.", dir=store.spool_directory(""))
        temp = Path(temp_name)
        try:
            self._step("records_temp_created")
            with checkpoint_span(WRITE_SPAN, id=self.checkpoint_id) as span:
                digest, count, size = self._stream(
                    fd, records, sync=not is_object_store_url(self.location)
                )
                set_checkpoint_attributes(span, records=count, bytes=size)
            self.bytes_written = size
            self._step("records_synced")
            try:
                manifest = build_manifest(
                    kind=self.kind,
                    instance=self.instance,
                    checkpoint_id=self.checkpoint_id,
                    records_sha256=digest,
                    record_count=count,
                    extra=extra,
                )
                manifest_bytes = serialize_manifest(manifest)
            except (TypeError, ValueError) as exc:
                raise InvalidCheckpointStateError(f"cannot build the manifest: {exc}") from exc
            records_key = manifest["records_file"]
            with self._stop_lock:
                self._raise_if_stopped()
                # Same name means same bytes, so an earlier identical records object is harmless;
                # the name is durable before any manifest points at it.
                store.publish_file(records_key, temp)
                self._step("records_renamed")
                with checkpoint_span(MANIFEST_SPAN, id=self.checkpoint_id):
                    self._step("manifest_temp_synced")
                    # Never replaces an existing manifest: of two racing writers one wins.
                    created = store.create(MANIFEST_FILE, manifest_bytes)
                    if created:
                        self._step("manifest_linked")
            if created:
                self._step("published")
                return manifest
            return self._resolve_existing(store, manifest, records_key)
        finally:
            temp.unlink(missing_ok=True)

    def _stream(
        self, fd: int, records: Iterable[Mapping[str, Any]], *, sync: bool
    ) -> tuple[str, int, int]:
        hasher = hashlib.sha256()
        count = 0
        size = 0
        pending: list[bytes] = []
        pending_size = 0
        with os.fdopen(fd, "wb") as handle:
            for record in records:
                self._raise_if_stopped()
                try:
                    line = encode_record_line(record)
                except (TypeError, ValueError) as exc:
                    raise InvalidCheckpointStateError(
                        f"record {count} cannot be stored (finite JSON only): {exc}"
                    ) from exc
                pending.append(line)
                pending_size += len(line)
                count += 1
                size += len(line)
                if pending_size >= RECORDS_CHUNK_BYTES:
                    _write_chunk(handle, hasher, pending)
                    pending_size = 0
            _write_chunk(handle, hasher, pending)
            self._step("records_streamed")
            handle.flush()
            if sync:  # on S3 the put makes the records durable; a local spool needs no fsync
                os.fsync(handle.fileno())  # the records are on disk before any name points at them
        return hasher.hexdigest(), count, size

    def _resolve_existing(
        self, store: CheckpointStore, manifest: dict[str, Any], records_key: str
    ) -> dict[str, Any]:
        existing = _load_manifest_object(store)
        if existing == manifest:
            return existing
        if existing.get("records_file") != records_key:
            store.delete([records_key])  # the loser's own records; a directory is synced after
        raise InvalidCheckpointStateError(
            f"{self.location} already holds a different commit "
            f"(checkpoint {existing.get('checkpoint_id')!r})"
        )

    def _raise_if_stopped(self) -> None:
        if self._stopped:
            raise InvalidCheckpointStateError(
                f"the write of checkpoint {self.checkpoint_id!r} was stopped by resume"
            )

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)


@dataclass(frozen=True, slots=True)
class ParticipantCheckpoint:
    """One participant's verified share of a checkpoint.

    Attributes:
        manifest: The manifest object as published.
        records: The records the select filter kept, in file order, key order preserved.
        bytes_read: The size of the records file.
    """

    manifest: dict[str, Any]
    records: list[dict[str, Any]]
    bytes_read: int


def read_participant_checkpoint(
    location: ShareLocation,
    *,
    kind: ParticipantKind,
    instance: str,
    select: Callable[[dict[str, Any]], bool] | None = None,
) -> ParticipantCheckpoint:
    """Read and verify one participant's share in a single streaming pass.

    ``location`` is the share (``<checkpoint>/gym/<kind>/<instance>``): a directory, or the same
    as an ``s3://`` URL. Every line is hashed, counted and parsed; ``select`` decides which
    records are kept, while the digest and count still cover the whole file. Blocking: run it in
    a worker thread.

    Raises:
        InvalidCheckpointStateError: The manifest is missing (a partial commit), malformed, of
            another kind or instance, names an unsafe file, the records do not match it, or I/O
            failed.
    """
    store = open_share(location)
    manifest = _load_manifest_object(store)
    checked = _check_manifest(manifest, store.describe(MANIFEST_FILE), kind=kind, instance=instance)
    where = store.describe(checked.records_file)
    hasher = hashlib.sha256()
    count = 0
    size = 0
    kept: list[dict[str, Any]] = []
    try:
        for line in store.lines(checked.records_file):
            hasher.update(line)
            size += len(line)
            count += 1
            try:
                record = decode_record_line(line)
            except ValueError as exc:
                raise InvalidCheckpointStateError(
                    f"{where}: line {count} is not a JSON object: {exc}"
                ) from exc
            if select is None or select(record):
                kept.append(record)
    except FileNotFoundError as exc:  # ObjectMissingError too
        raise InvalidCheckpointStateError(
            f"{where} is missing but {store.describe(MANIFEST_FILE)} names it"
        ) from exc
    except OSError as exc:
        raise InvalidCheckpointStateError(f"I/O error reading {where}: {exc}") from exc
    if count != checked.record_count:
        raise InvalidCheckpointStateError(
            f"{where} holds {count} records, the manifest says {checked.record_count}"
        )
    if hasher.hexdigest() != checked.records_sha256:
        raise InvalidCheckpointStateError(
            f"{where} has digest {hasher.hexdigest()}, the manifest says {checked.records_sha256}"
        )
    return ParticipantCheckpoint(manifest=manifest, records=kept, bytes_read=size)


def _load_manifest_object(store: CheckpointStore) -> dict[str, Any]:
    where = store.describe(MANIFEST_FILE)
    try:
        raw = store.read(MANIFEST_FILE)
    except (ObjectMissingError, FileNotFoundError) as exc:
        raise InvalidCheckpointStateError(
            f"{where} does not exist: the commit is partial or was never made"
        ) from exc
    except OSError as exc:
        raise InvalidCheckpointStateError(f"I/O error reading {where}: {exc}") from exc
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidCheckpointStateError(f"{where} is not a JSON object")
    return value


def _check_manifest(
    manifest: dict[str, Any], where: str, *, kind: str, instance: str
) -> ParticipantManifest:
    records_file = manifest.get("records_file")
    if isinstance(records_file, str) and not is_records_file_name(records_file):
        raise InvalidCheckpointStateError(f"{where} names an unsafe records file {records_file!r}")
    try:
        checked = ParticipantManifest.model_validate(manifest, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        raise InvalidCheckpointStateError(f"{where} is malformed: {problems}") from None
    if (checked.kind, checked.instance) != (kind, instance):
        raise InvalidCheckpointStateError(
            f"{where} belongs to {checked.kind}/{checked.instance}, not {kind}/{instance}"
        )
    return checked
