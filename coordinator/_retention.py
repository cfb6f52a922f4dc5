"""What the controller does with published checkpoints afterwards: pin, and collect garbage.

All functions here are blocking store work (call them from a worker thread inside an event loop),
on a run root that is a directory or ``s3://bucket/prefix``.

- :func:`pin_checkpoint` / :func:`unpin_checkpoint` add or remove a ``PINNED`` marker;
  :func:`is_pinned` says whether there is one.
- :func:`collect_garbage` removes partial commits and published checkpoints beyond the newest
  ``keep``, never the target of ``LATEST`` nor a pinned checkpoint (D334): both are re-read from
  the store right before each removal, and a checkpoint loses its ``checkpoint.json`` first, so
  one removed halfway reads as a partial commit, never as published with shares missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, overload

from protocols import (
    CheckpointStore,
    is_object_store_url,
    open_store,
    validate_checkpoint_id,
)

from ._layout import (
    CHECKPOINT_FILE,
    CHECKPOINTS_SUBDIR,
    PINNED_FILE,
    checkpoint_key,
    is_protected,
    latest_id,
)
from ._publish import CheckpointManifest

_PIN: Final = b"pinned\n"
OBJECT_TIME_SLACK: Final = 2.0
"""Seconds a partial commit on an object store must predate the newest publication to be old.

S3 gives ``LastModified`` to the second and by its own clock, not the controller's: without the
slack a share written just after a publication, in the same second, would look older than it.
"""


@overload
def pin_checkpoint(root: Path, checkpoint_id: str) -> Path: ...
@overload
def pin_checkpoint(root: str, checkpoint_id: str) -> str: ...
def pin_checkpoint(root: str | Path, checkpoint_id: str) -> str | Path:
    """Protect a published checkpoint from garbage collection (writes ``PINNED``).

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.
        checkpoint_id: The published checkpoint to protect.

    Returns:
        The marker: its path for a ``Path`` root, else its path or ``s3://`` URL as a string.

    Raises:
        ValueError: The id is unsafe, no published checkpoint has this id, or it was collected
            while the marker was written (the marker is removed again), or a malformed URL.
    """
    store = open_store(root)
    manifest = checkpoint_key(checkpoint_id, CHECKPOINT_FILE)
    where = store.describe(checkpoint_key(checkpoint_id))
    if not store.exists(manifest):
        raise ValueError(f"{where} is not a published checkpoint")
    marker = checkpoint_key(checkpoint_id, PINNED_FILE)
    store.replace(marker, _PIN)  # durable: a pin lost to a crash would let gc delete it
    if not store.exists(manifest):
        # gc removed it between the check and the marker: the pin protects nothing, say so.
        store.delete([marker])
        raise ValueError(f"{where} was collected by gc while it was being pinned")
    return Path(store.describe(marker)) if isinstance(root, Path) else store.describe(marker)


def is_pinned(root: str | Path, checkpoint_id: str) -> bool:
    """Whether the checkpoint holds the ``PINNED`` marker (``gc`` never removes it then).

    Raises:
        ValueError: The id is unsafe, or a malformed ``s3://`` URL.
    """
    return open_store(root).exists(checkpoint_key(checkpoint_id, PINNED_FILE))


def unpin_checkpoint(root: str | Path, checkpoint_id: str) -> bool:
    """Remove the ``PINNED`` marker; whether there was one.

    Raises:
        ValueError: The id is unsafe, or a malformed ``s3://`` URL.
    """
    store = open_store(root)
    marker = checkpoint_key(checkpoint_id, PINNED_FILE)
    if not store.exists(marker):
        return False
    store.delete([marker])  # durable (the directory is synced): the unpin is a deliberate act
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


@dataclass(frozen=True)
class _Listed:
    """One checkpoint as gc found it: its id, size, age and whether it was published."""

    checkpoint_id: str
    size: int
    newest: float
    published_at: float | None


def _tree(store: CheckpointStore, checkpoint_id: str) -> tuple[int, float, float | None]:
    """Bytes, newest modification time and ``checkpoint.json``'s time of one checkpoint.

    A directory counts everything in it, temp files and its subdirectories' own times included:
    a participant still writing one is a commit under way. An object store has no temp objects.
    """
    prefix = checkpoint_key(checkpoint_id)
    if not is_object_store_url(store.url):
        directory = Path(store.url) / prefix
        entries = [p for p in directory.rglob("*") if not p.is_symlink()]
        size = sum(p.stat().st_size for p in entries if p.is_file())
        newest = max([directory.stat().st_mtime, *(p.stat().st_mtime for p in entries)])
        json_path = directory / CHECKPOINT_FILE
        return size, newest, json_path.stat().st_mtime if json_path.is_file() else None
    objects = store.list_objects(prefix)
    json_key = checkpoint_key(checkpoint_id, CHECKPOINT_FILE)
    json_time = next((o.modified for o in objects if o.key == json_key), None)
    return sum(o.size for o in objects), max(o.modified for o in objects), json_time


def _listed(store: CheckpointStore, checkpoint_id: str) -> _Listed | None:
    try:
        size, newest, json_time = _tree(store, checkpoint_id)
    except (FileNotFoundError, ValueError):
        return None  # removed meanwhile (another gc), or empty
    if json_time is None:
        return _Listed(checkpoint_id, size, newest, None)
    try:
        manifest = store.read(checkpoint_key(checkpoint_id, CHECKPOINT_FILE))
        published_at = CheckpointManifest.model_validate_json(manifest).created_at
    except (OSError, ValueError):
        published_at = json_time  # unreadable: rank it by when it was written
    return _Listed(checkpoint_id, size, newest, published_at)


def _collect(store: CheckpointStore, listed: _Listed) -> bool:
    """Remove one checkpoint unless, read again now, ``LATEST`` names it or it is pinned.

    ``checkpoint.json`` goes first: from then on the rest is a partial commit to every reader.
    """
    checkpoint_id = listed.checkpoint_id
    manifest = checkpoint_key(checkpoint_id, CHECKPOINT_FILE)
    if is_protected(store, checkpoint_id):
        return False
    if listed.published_at is None:
        if store.exists(manifest):
            return False  # a partial commit that was published since it was listed
    else:
        store.delete([manifest])
    store.delete_tree(checkpoint_key(checkpoint_id))
    return True


def collect_garbage(root: str | Path, keep: int, *, dry_run: bool = False) -> GcReport:
    """Remove partial commits and the published checkpoints beyond the newest ``keep``.

    A partial commit is a checkpoint without ``checkpoint.json``; it is removed only when nothing
    in it is newer than the newest published checkpoint (an older one can never be published any
    more; a newer one may be a commit under way; on an object store "older" means by more than
    ``OBJECT_TIME_SLACK``). Whatever ``LATEST`` names and every checkpoint holding ``PINNED``
    are kept whatever their age; both are read again right before each removal, so a pin or a
    publication made while gc runs is honoured (D334).

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.
        keep: How many published checkpoints to keep, newest first.
        dry_run: Only report what would be removed.

    Raises:
        ValueError: ``keep`` is below 1 (the newest checkpoint is always kept), or a malformed
            ``s3://`` URL.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1: gc never removes the newest checkpoint")
    store = open_store(root)
    names = [name for name in store.subdirectories(CHECKPOINTS_SUBDIR) if _is_id(name)]
    latest = latest_id(store) if names else ""
    found = [listed for name in names if (listed := _listed(store, name)) is not None]
    published = sorted(
        (f for f in found if f.published_at is not None),
        key=lambda f: (f.published_at, f.checkpoint_id),
        reverse=True,
    )
    cutoff = published[0].published_at if published else None  # older partials are dead
    if cutoff is not None and is_object_store_url(store.url):
        cutoff -= OBJECT_TIME_SLACK
    kept: list[str] = []
    protected: list[str] = []
    doomed: list[_Listed] = []
    for rank, listed in enumerate(published):
        name = listed.checkpoint_id
        if rank < keep:
            kept.append(name)
        elif name == latest or store.exists(checkpoint_key(name, PINNED_FILE)):
            kept.append(name)
            protected.append(name)
        else:
            doomed.append(listed)
    for listed in sorted((f for f in found if f.published_at is None), key=lambda f: f.newest):
        name = listed.checkpoint_id
        if name == latest or store.exists(checkpoint_key(name, PINNED_FILE)):
            protected.append(name)
        elif cutoff is not None and listed.newest < cutoff:
            doomed.append(listed)
    removed: list[str] = []
    reclaimed = 0
    for listed in sorted(doomed, key=lambda d: d.checkpoint_id):
        if not dry_run and not _collect(store, listed):
            protected.append(listed.checkpoint_id)  # pinned or made LATEST while gc ran
            if listed.published_at is not None:
                kept.append(listed.checkpoint_id)
            continue
        removed.append(listed.checkpoint_id)
        reclaimed += listed.size
    partial = [d.checkpoint_id for d in doomed if d.published_at is None]
    return GcReport(
        removed=removed,
        partial=[name for name in removed if name in partial],
        kept=kept,
        protected=sorted(protected),
        bytes_reclaimed=reclaimed,
        dry_run=dry_run,
    )


def _is_id(name: str) -> bool:
    """Whether a name under ``checkpoints/`` can be a checkpoint (anything else is left alone)."""
    try:
        validate_checkpoint_id(name)
    except ValueError:
        return False
    return True
