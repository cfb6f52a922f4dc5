"""Opening the store a location names: a directory, or an ``s3://`` prefix."""

from __future__ import annotations

from pathlib import Path

from .interface import CheckpointStore, is_object_store_url
from .posix import PosixCheckpointStore


def open_store(location: str | Path) -> CheckpointStore:
    """The store rooted at ``location``: a directory path, or ``s3://bucket/prefix``.

    An object store takes its endpoint, region and credentials from the standard ``AWS_*``
    environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, …) and needs the ``s3``
    extra (``obstore``).

    Raises:
        ValueError: A malformed ``s3://`` URL, or the ``s3`` extra is not installed.
    """
    if is_object_store_url(location):
        from .objects import S3CheckpointStore  # only an s3:// root needs obstore

        return S3CheckpointStore(str(location))
    return PosixCheckpointStore(Path(location))
