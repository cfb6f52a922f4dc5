"""The checkpoint store: named objects with conditional writes, on a directory or a bucket (D327).

Checkpoints are kept as objects under a store root: a directory (``/data/run``) or an object
store prefix (``s3://bucket/prefix``). Keys are relative, ``/``-separated and made of safe
segments, so nothing a key names leaves the root. Every guarantee the checkpoint layout needs is
one of four writes:

- ``publish_file``: a spooled local file becomes the object of a content-addressed key (same key,
  same bytes; an object already there is kept);
- ``create``: write only if the key is absent; of two racing writers exactly one wins;
- ``replace``: an unconditional atomic replace (a ``PINNED`` marker);
- ``replace_if``: replace only the version read before (the ``LATEST`` pointer).

Every method blocks; call them from a worker thread inside an event loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

from .._errors import MidflightError

S3_SCHEME: Final = "s3://"
_SEGMENT: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class StoreError(MidflightError, OSError):
    """A store operation failed (I/O, the network, credentials); nothing was changed by it."""


class ObjectMissingError(StoreError, FileNotFoundError):
    """The key names no object."""


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object under a prefix: its key (from the store root), size and modification time."""

    key: str
    size: int
    modified: float


@runtime_checkable
class CheckpointStore(Protocol):
    """Where checkpoints are kept; see the module docstring for what each write guarantees."""

    @property
    def url(self) -> str:
        """The root: an absolute directory path, or ``s3://bucket/prefix``."""
        ...

    def describe(self, key: str) -> str:
        """Where ``key`` lives, for messages: a path, or an ``s3://`` URL."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object has this key."""
        ...

    def read(self, key: str) -> bytes:
        """The object's bytes. Raises ObjectMissingError."""
        ...

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and version (for ``replace_if``); ``None`` when absent."""
        ...

    def lines(self, key: str) -> Iterator[bytes]:
        """The object's lines (newline kept), streamed. Raises ObjectMissingError."""
        ...

    def spool_directory(self, prefix: str) -> Path:
        """A local directory to stage a file in before ``publish_file`` to a key under ``prefix``."""
        ...

    def publish_file(self, key: str, source: Path) -> None:
        """Make the spooled file ``source`` the object ``key`` (content-addressed: an existing
        object is kept). ``source`` is consumed."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if ``key`` is absent; False when an object is already there.

        On S3 an object holding exactly ``data`` counts as written (True): a retried put finds
        its own first try there when that try's answer was lost.
        """
        ...

    def replace(self, key: str, data: bytes) -> None:
        """Replace the object atomically, whatever was there."""
        ...

    def replace_if(self, key: str, data: bytes, version: str | None) -> bool:
        """Replace the object only if it is still at ``version`` (``None``: still absent).

        Returns False when another writer moved it first; nothing was written then.
        """
        ...

    def list_objects(self, prefix: str) -> list[StoredObject]:
        """Every object below ``prefix`` (any depth), in key order."""
        ...

    def subdirectories(self, prefix: str) -> list[str]:
        """The names one level below ``prefix`` that hold objects, sorted."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects; a key already gone is fine."""
        ...

    def delete_tree(self, prefix: str) -> None:
        """Remove every object below ``prefix``."""
        ...


def store_key(*parts: str) -> str:
    """Join key parts (each may hold ``/``), checking every segment is safe.

    Raises:
        ValueError: A segment is empty, ``.``/``..``, or holds other characters than letters,
            digits, ``.``, ``_`` and ``-``.
    """
    segments = [segment for part in parts for segment in part.split("/")]
    for segment in segments:
        if not _SEGMENT.fullmatch(segment):
            raise ValueError(f"{'/'.join(segments)[:300]!r}: {segment[:100]!r} is not a safe key")
    return "/".join(segments)


def is_object_store_url(location: str | Path) -> bool:
    """Whether ``location`` names an object store (``s3://…``) rather than a directory."""
    return isinstance(location, str) and location.startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix); the prefix may be empty.

    Raises:
        ValueError: Not an ``s3://`` URL, no bucket, or an unsafe prefix segment.
    """
    if not url.startswith(S3_SCHEME):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len(S3_SCHEME) :].strip("/").partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name")
    return bucket, store_key(prefix) if prefix else ""


def key_under(store: CheckpointStore, location: str | Path) -> str:
    """The key of ``location`` (a path or URL under the store root); ``""`` for the root.

    Raises:
        ValueError: ``location`` is not under the store's root, or names an unsafe key.
    """
    root = store.url
    text = str(location)
    if is_object_store_url(root) != is_object_store_url(text):
        raise ValueError(f"{text!r} is not in the store {root!r}")
    if text.rstrip("/") == root:
        return ""
    if not text.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"{text!r} is not under the store root {root!r}")
    return store_key(text[len(root.rstrip("/")) + 1 :].strip("/"))
