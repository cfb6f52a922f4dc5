"""Where checkpoints live under a run root, and the errors of two publications that collide.

A run root is a directory (``/data/run``) or an object store prefix (``s3://bucket/prefix``); the
coordinator reaches both through ``protocols.open_store``, with the same keys::

    checkpoints/<id>/gym/<kind>/<instance>/...   each participant's commit
    checkpoints/<id>/checkpoint.json             the aggregate manifest, written last
    checkpoints/<id>/PINNED                      gc never removes this checkpoint
    checkpoints/LATEST                           the id of the newest published checkpoint

Error tree (see ``protocols._errors``)::

    PublicationConflictError       another publication got to the store first
    ├── CheckpointTakenError       the id's checkpoint.json holds another publication
    └── LatestMovedError           another publisher moved LATEST after this one read it
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from protocols import (
    S3_SCHEME,
    CheckpointStore,
    MidflightError,
    is_object_store_url,
    split_s3_url,
    store_key,
    validate_checkpoint_id,
)

CHECKPOINTS_SUBDIR: Final = "checkpoints"
CHECKPOINT_FILE: Final = "checkpoint.json"
LATEST_FILE: Final = "LATEST"
PINNED_FILE: Final = "PINNED"
LATEST_KEY: Final = f"{CHECKPOINTS_SUBDIR}/{LATEST_FILE}"


def checkpoint_key(checkpoint_id: str, *parts: str) -> str:
    """``checkpoints/<id>[/<parts>…]``: a key under the run root.

    Raises:
        ValueError: The id, or a part, is not a safe key.
    """
    return store_key(CHECKPOINTS_SUBDIR, validate_checkpoint_id(checkpoint_id), *parts)


def checkpoint_directory(root: Path, checkpoint_id: str) -> Path:
    """``<root>/checkpoints/<id>`` of a directory root: the ``checkpoint_dir`` to commit into.

    Raises:
        ValueError: The id is not a safe path component, or ``root`` is an ``s3://`` URL (it has
            no directory: use :func:`checkpoint_location`).
    """
    if is_object_store_url(root):
        raise ValueError(f"{root} is an object store: use checkpoint_location, not a directory")
    return Path(root) / CHECKPOINTS_SUBDIR / validate_checkpoint_id(checkpoint_id)


def checkpoint_location(root: str | Path, checkpoint_id: str) -> str:
    """Where checkpoint ``checkpoint_id`` of ``root`` lives: the ``checkpoint_dir`` to send.

    Args:
        root: The run root: a directory, or ``s3://bucket/prefix``.
        checkpoint_id: The checkpoint's id.

    Returns:
        ``<root>/checkpoints/<id>`` as a path string (what :func:`checkpoint_directory` gives),
        or its ``s3://bucket/prefix/checkpoints/<id>`` URL.

    Raises:
        ValueError: An unsafe id, or a malformed ``s3://`` URL.
    """
    if is_object_store_url(root):
        bucket, prefix = split_s3_url(str(root))
        return S3_SCHEME + "/".join(p for p in (bucket, prefix, checkpoint_key(checkpoint_id)) if p)
    return str(checkpoint_directory(Path(root), checkpoint_id))


def latest_id(store: CheckpointStore) -> str:
    """What ``LATEST`` names, unchecked (``""`` when there is no ``LATEST``)."""
    current = store.read_versioned(LATEST_KEY)
    return "" if current is None else current[0].decode("utf-8", "replace").strip()


def is_protected(store: CheckpointStore, checkpoint_id: str) -> bool:
    """Whether ``LATEST`` names the checkpoint or it holds ``PINNED``, read from the store now."""
    return latest_id(store) == checkpoint_id or store.exists(
        checkpoint_key(checkpoint_id, PINNED_FILE)
    )


class PublicationConflictError(MidflightError):
    """Another publication got to the store first; nothing it wrote was overwritten.

    Attributes:
        checkpoint_id: The checkpoint this publisher published, or tried to.
        location: Its ``checkpoint.json`` (a path, or an ``s3://`` URL).
    """

    def __init__(self, message: str, *, checkpoint_id: str, location: str) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.location = location


class CheckpointTakenError(PublicationConflictError):
    """The id's ``checkpoint.json`` already holds another publication (other shares or scope).

    Nothing was written: publish the commit under a fresh checkpoint id.
    """


class LatestMovedError(PublicationConflictError):
    """Another publisher moved ``LATEST`` after this one read it, before it could move it.

    This checkpoint's ``checkpoint.json`` stays published (``read_checkpoint`` reads it);
    ``LATEST`` names what the other publisher wrote.

    Attributes:
        latest: What ``LATEST`` names now (``""`` when it is gone).
    """

    def __init__(self, message: str, *, checkpoint_id: str, location: str, latest: str) -> None:
        super().__init__(message, checkpoint_id=checkpoint_id, location=location)
        self.latest = latest
