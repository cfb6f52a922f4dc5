"""Writing and reading one participant's share of a checkpoint.

Layout: ``<checkpoint>/gym/<kind>/<instance>/records-<sha256>.jsonl`` and ``manifest.json``. The
manifest is published last, exactly once, through a hard link (which never replaces an existing
name), so a directory with a manifest never changes and a directory without one is a partial
commit that readers ignore.
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
from typing import Any, Final

from pydantic import ValidationError

from protocols import (
    MANIFEST_FILE,
    MANIFEST_SPAN,
    WRITE_SPAN,
    InvalidCheckpointStateError,
    ParticipantKind,
    ParticipantManifest,
    build_manifest,
    decode_record_line,
    encode_record_line,
    is_records_file_name,
    serialize_manifest,
)

from .._tracing import checkpoint_span, set_checkpoint_attributes
from .durable import fsync_directory, make_directory_durable

WRITE_STEPS: Final = (
    "records_temp_created",
    "records_streamed",
    "records_synced",
    "records_renamed",
    "manifest_temp_synced",
    "manifest_linked",
    "published",
)
"""Named points of a write, in order; a test hook can stop at each to prove crash safety."""

_READ_CHUNK: Final = 1 << 20


class RecordsWriter:
    """Publishes one participant's records and manifest for one checkpoint.

    ``write`` blocks (run it in a worker thread); ``stop`` may be called from any thread. Once
    ``stop`` returns, this writer never publishes: it waits only for a publication already under
    way.

    Args:
        directory: The participant directory, ``<checkpoint>/gym/<kind>/<instance>``.
        kind: The participant kind written into the manifest.
        instance: The participant instance written into the manifest.
        checkpoint_id: The checkpoint this share belongs to.
        on_step: Called with each name of ``WRITE_STEPS`` as the write reaches it (tests only).
    """

    def __init__(
        self,
        directory: Path,
        *,
        kind: ParticipantKind,
        instance: str,
        checkpoint_id: str,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
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
        """Stream the records to disk and publish the manifest.

        Returns:
            The published manifest. If the directory already holds an identical manifest (a
            repeat of the same commit), that manifest.

        Raises:
            InvalidCheckpointStateError: The writer was stopped, a record cannot be stored, the
                directory already holds a different commit, or I/O failed. Nothing is published.
        """
        try:
            return self._write(records, extra)
        except InvalidCheckpointStateError:
            raise
        except OSError as exc:
            raise InvalidCheckpointStateError(
                f"I/O error writing {self.directory}: {exc.strerror or exc}"
            ) from exc

    def _write(
        self, records: Iterable[Mapping[str, Any]], extra: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        self._raise_if_stopped()
        make_directory_durable(self.directory)
        fd, temp_name = tempfile.mkstemp(prefix=".records.jsonl.", dir=self.directory)
        temp = Path(temp_name)
        try:
            self._step("records_temp_created")
            with checkpoint_span(WRITE_SPAN, id=self.checkpoint_id) as span:
                digest, count, size = self._stream(fd, records)
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
            with self._stop_lock:
                self._raise_if_stopped()
                records_path = self.directory / manifest["records_file"]
                # Same name means same bytes, so replacing an earlier identical file is harmless.
                os.replace(temp, records_path)
                fsync_directory(self.directory)  # the records name is durable before a manifest
                self._step("records_renamed")
                with checkpoint_span(MANIFEST_SPAN, id=self.checkpoint_id):
                    created = self._publish_manifest(manifest_bytes)
            if created:
                self._step("published")
                return manifest
            return self._resolve_existing(manifest, records_path)
        finally:
            temp.unlink(missing_ok=True)

    def _stream(self, fd: int, records: Iterable[Mapping[str, Any]]) -> tuple[str, int, int]:
        hasher = hashlib.sha256()
        count = 0
        size = 0
        with os.fdopen(fd, "wb") as handle:
            for record in records:
                self._raise_if_stopped()
                try:
                    line = encode_record_line(record)
                except (TypeError, ValueError) as exc:
                    raise InvalidCheckpointStateError(
                        f"record {count} cannot be stored (finite JSON only): {exc}"
                    ) from exc
                handle.write(line)
                hasher.update(line)
                count += 1
                size += len(line)
            self._step("records_streamed")
            handle.flush()
            os.fsync(handle.fileno())  # the records must be on disk before any name points at them
        return hasher.hexdigest(), count, size

    def _publish_manifest(self, manifest_bytes: bytes) -> bool:
        fd, temp_name = tempfile.mkstemp(prefix=".manifest.json.", dir=self.directory)
        temp = Path(temp_name)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(manifest_bytes)
                handle.flush()
                os.fsync(handle.fileno())  # the manifest's bytes are durable before its name
            self._step("manifest_temp_synced")
            try:
                # A hard link never replaces an existing name: of two racing writers one wins.
                os.link(temp, self.directory / MANIFEST_FILE)
            except FileExistsError:
                return False
            self._step("manifest_linked")
            fsync_directory(self.directory)  # publication itself survives a power loss
            return True
        finally:
            temp.unlink(missing_ok=True)

    def _resolve_existing(self, manifest: dict[str, Any], records_path: Path) -> dict[str, Any]:
        existing = _load_manifest_object(self.directory / MANIFEST_FILE)
        if existing == manifest:
            return existing
        if existing.get("records_file") != records_path.name:
            records_path.unlink(missing_ok=True)
            fsync_directory(self.directory)
        raise InvalidCheckpointStateError(
            f"{self.directory} already holds a different commit "
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
    directory: Path,
    *,
    kind: ParticipantKind,
    instance: str,
    select: Callable[[dict[str, Any]], bool] | None = None,
) -> ParticipantCheckpoint:
    """Read and verify one participant's share in a single streaming pass.

    Every line is hashed, counted and parsed; ``select`` decides which records are kept, while
    the digest and count still cover the whole file. Blocking: run it in a worker thread.

    Raises:
        InvalidCheckpointStateError: The manifest is missing (a partial commit), malformed, of
            another kind or instance, names an unsafe file, or the records do not match it.
    """
    directory = Path(directory)
    manifest = _load_manifest_object(directory / MANIFEST_FILE)
    checked = _check_manifest(manifest, directory, kind=kind, instance=instance)
    records_path = directory / checked.records_file
    hasher = hashlib.sha256()
    count = 0
    size = 0
    kept: list[dict[str, Any]] = []
    try:
        with open(records_path, "rb", buffering=_READ_CHUNK) as handle:
            for line in handle:
                hasher.update(line)
                size += len(line)
                count += 1
                try:
                    record = decode_record_line(line)
                except ValueError as exc:
                    raise InvalidCheckpointStateError(
                        f"{records_path}: line {count} is not a JSON object: {exc}"
                    ) from exc
                if select is None or select(record):
                    kept.append(record)
    except FileNotFoundError as exc:
        raise InvalidCheckpointStateError(
            f"{records_path} is missing but {directory / MANIFEST_FILE} names it"
        ) from exc
    except OSError as exc:
        raise InvalidCheckpointStateError(f"I/O error reading {records_path}: {exc}") from exc
    if count != checked.record_count:
        raise InvalidCheckpointStateError(
            f"{records_path} holds {count} records, the manifest says {checked.record_count}"
        )
    if hasher.hexdigest() != checked.records_sha256:
        raise InvalidCheckpointStateError(
            f"{records_path} has digest {hasher.hexdigest()}, "
            f"the manifest says {checked.records_sha256}"
        )
    return ParticipantCheckpoint(manifest=manifest, records=kept, bytes_read=size)


def _load_manifest_object(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise InvalidCheckpointStateError(
            f"{path} does not exist: the commit is partial or was never made"
        ) from exc
    except OSError as exc:
        raise InvalidCheckpointStateError(f"I/O error reading {path}: {exc}") from exc
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidCheckpointStateError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidCheckpointStateError(f"{path} is not a JSON object")
    return value


def _check_manifest(
    manifest: dict[str, Any], directory: Path, *, kind: str, instance: str
) -> ParticipantManifest:
    where = directory / MANIFEST_FILE
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
