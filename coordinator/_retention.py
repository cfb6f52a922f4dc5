"""What the controller does with published checkpoints afterwards: verify, pin, collect garbage.

All functions here are blocking file work (call them from a worker thread inside an event loop).

- :func:`verify_checkpoint` re-reads a checkpoint end to end: ``checkpoint.json``, each
  participant manifest against its recorded SHA-256, each records file against its manifest's
  digest and line count.
- :func:`pin_checkpoint` / :func:`unpin_checkpoint` add or remove a ``PINNED`` marker.
- :func:`collect_garbage` removes partial commits and published checkpoints beyond the newest
  ``keep``, never the target of ``LATEST`` nor a pinned checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from protocols import (
    ParticipantManifest,
    is_records_file_name,
    validate_checkpoint_id,
)

from ._publish import (
    CHECKPOINT_FILE,
    CHECKPOINTS_SUBDIR,
    LATEST_FILE,
    CheckpointManifest,
    _fsync_directory,
    _replace_durably,
)

PINNED_FILE: Final = "PINNED"
_CHUNK: Final = 1 << 20


def _sha256_of(path: Path) -> tuple[str, int]:
    """SHA-256 and line count of a file, streamed."""
    digest = hashlib.sha256()
    lines = 0
    with open(path, "rb") as handle:
        for line in handle:
            digest.update(line)
            lines += 1
    return digest.hexdigest(), lines


def verify_checkpoint(directory: Path) -> list[str]:
    """Every way a published checkpoint differs from what it claims (empty when it is intact).

    Args:
        directory: ``<root>/checkpoints/<id>``.

    Returns:
        One precise message per problem found, naming the file concerned.
    """
    directory = Path(directory)
    path = directory / CHECKPOINT_FILE
    try:
        manifest = CheckpointManifest.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        return [f"{path}: unreadable checkpoint.json ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    if manifest.checkpoint_id != directory.name:
        problems.append(
            f"{path}: names checkpoint {manifest.checkpoint_id!r}, directory is {directory.name!r}"
        )
    for share in manifest.participants:
        manifest_path = directory / share.manifest
        try:
            data = manifest_path.read_bytes()
        except OSError as exc:
            problems.append(f"{manifest_path}: missing manifest of {share.instance} ({exc})")
            continue
        actual = hashlib.sha256(data).hexdigest()
        if actual != share.manifest_sha256:
            problems.append(
                f"{manifest_path}: sha256 {actual} but checkpoint.json records "
                f"{share.manifest_sha256}"
            )
            continue
        try:
            participant = ParticipantManifest.model_validate(json.loads(data))
        except ValueError as exc:
            problems.append(f"{manifest_path}: not a participant manifest ({exc})")
            continue
        if (participant.kind, participant.instance) != (share.kind, share.instance):
            problems.append(
                f"{manifest_path}: belongs to {participant.kind}/{participant.instance}, "
                f"checkpoint.json lists {share.kind}/{share.instance}"
            )
        if participant.checkpoint_id != manifest.checkpoint_id:
            problems.append(
                f"{manifest_path}: names checkpoint {participant.checkpoint_id!r}, "
                f"expected {manifest.checkpoint_id!r}"
            )
        if not is_records_file_name(participant.records_file):
            problems.append(f"{manifest_path}: unsafe records file {participant.records_file!r}")
            continue
        records = manifest_path.parent / participant.records_file
        try:
            digest, count = _sha256_of(records)
        except OSError as exc:
            problems.append(f"{records}: missing records file ({exc})")
            continue
        if digest != participant.records_sha256:
            problems.append(
                f"{records}: sha256 {digest} but its manifest records {participant.records_sha256}"
            )
        if count != participant.record_count:
            problems.append(
                f"{records}: {count} records but its manifest records {participant.record_count}"
            )
    return problems


def pin_checkpoint(root: Path, checkpoint_id: str) -> Path:
    """Protect a published checkpoint from garbage collection (writes ``PINNED``).

    Raises:
        ValueError: The id is unsafe, or no published checkpoint has this id.
    """
    directory = Path(root) / CHECKPOINTS_SUBDIR / validate_checkpoint_id(checkpoint_id)
    if not (directory / CHECKPOINT_FILE).is_file():
        raise ValueError(f"{directory} is not a published checkpoint")
    marker = directory / PINNED_FILE
    _replace_durably(marker, b"pinned\n")  # a pin lost to a crash would let gc delete it
    return marker


def unpin_checkpoint(root: Path, checkpoint_id: str) -> bool:
    """Remove the ``PINNED`` marker; whether there was one.

    Raises:
        ValueError: The id is unsafe.
    """
    directory = Path(root) / CHECKPOINTS_SUBDIR / validate_checkpoint_id(checkpoint_id)
    marker = directory / PINNED_FILE
    if not marker.exists():
        return False
    marker.unlink()
    _fsync_directory(directory)  # the unpin is a deliberate act: make it stick
    return True


@dataclass(frozen=True)
class GcReport:
    """What :func:`collect_garbage` removed (or would remove, on a dry run).

    Attributes:
        removed: Checkpoint ids removed, oldest first.
        partial: The subset of ``removed`` that were partial commits.
        kept: Checkpoint ids kept, newest first.
        protected: Ids kept only because ``LATEST`` names them or they are pinned.
        bytes_reclaimed: Bytes of the files removed.
        dry_run: Whether nothing was actually deleted.
    """

    removed: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    bytes_reclaimed: int = 0
    dry_run: bool = False


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def _tree_mtime(directory: Path) -> float:
    return max([directory.stat().st_mtime, *(p.stat().st_mtime for p in directory.rglob("*"))])


def _published_at(directory: Path) -> float:
    path = directory / CHECKPOINT_FILE
    try:
        return CheckpointManifest.model_validate_json(path.read_bytes()).created_at
    except (OSError, ValueError):
        return path.stat().st_mtime  # unreadable: rank it by when it was written


def collect_garbage(root: Path, keep: int, *, dry_run: bool = False) -> GcReport:
    """Remove partial commits and the published checkpoints beyond the newest ``keep``.

    A partial commit is a checkpoint directory without ``checkpoint.json``; it is removed only
    when nothing in it is newer than the newest published checkpoint (an older one can never be
    published any more; a newer one may be a commit under way). Whatever ``LATEST`` names and
    every directory holding ``PINNED`` are kept whatever their age.

    Raises:
        ValueError: ``keep`` is below 1 (the newest checkpoint is always kept).
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: gc never removes the newest checkpoint")
    base = Path(root) / CHECKPOINTS_SUBDIR
    report = GcReport(dry_run=dry_run)
    if not base.is_dir():
        return report
    try:
        latest = (base / LATEST_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        latest = ""
    published: list[tuple[float, str, Path]] = []
    partials: list[tuple[float, str, Path]] = []
    for entry in sorted(base.iterdir()):
        if not entry.is_dir() or entry.is_symlink() or entry.name.startswith("."):
            continue
        if (entry / CHECKPOINT_FILE).is_file():
            published.append((_published_at(entry), entry.name, entry))
        else:
            partials.append((_tree_mtime(entry), entry.name, entry))
    published.sort(reverse=True)
    newest = published[0][0] if published else None
    doomed: list[tuple[str, Path, bool]] = []
    for rank, (_, name, entry) in enumerate(published):
        guarded = name == latest or (entry / PINNED_FILE).exists()
        if rank < keep:
            report.kept.append(name)
        elif guarded:
            report.kept.append(name)
            report.protected.append(name)
        else:
            doomed.append((name, entry, False))
    for mtime, name, entry in sorted(partials):
        if name == latest or (entry / PINNED_FILE).exists():
            report.protected.append(name)
        elif newest is not None and mtime < newest:
            doomed.append((name, entry, True))
    reclaimed = 0
    for name, entry, partial in sorted(doomed, key=lambda d: d[0]):
        reclaimed += _tree_bytes(entry)
        report.removed.append(name)
        if partial:
            report.partial.append(name)
        if not dry_run:
            shutil.rmtree(entry)
    if doomed and not dry_run:
        _fsync_directory(base)  # the removals are final once the directory says so
    return GcReport(
        removed=report.removed,
        partial=report.partial,
        kept=report.kept,
        protected=sorted(report.protected),
        bytes_reclaimed=reclaimed,
        dry_run=dry_run,
    )
