"""Where commit and restore may read and write: under the checkpoint root (D240, D330).

A ``checkpoint_dir`` is a directory path or an ``s3://bucket/prefix`` URL, of the same kind as the
checkpoint root. A path must be absolute; with a root configured (every reference server has
one), it and the participant's own directory inside it must lie under the root once ``..`` and
every existing symlink are resolved. A URL must lie under an ``s3://`` root, every segment a safe
key (no ``..``, no empty segment); a server without a root refuses URLs, since it would not know
which bucket it may write. Any other ``checkpoint_dir`` is ``invalid_request`` and nothing is
touched.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from protocols import (
    InvalidRequestError,
    is_object_store_url,
    key_under,
    open_store,
    participant_directory,
)

from .checkpoint_store import ShareLocation


def checkpoint_path(checkpoint_dir: str, root: Path | str | None = None) -> ShareLocation:
    """The checkpoint location of a request: under ``root`` when one is set.

    With a directory root, the path is returned resolved (``..`` and every existing symlink
    followed), so what is written or read is exactly what was checked; with an ``s3://`` root,
    the URL is returned in its canonical form (the root's URL, ``/``, the key).

    Raises:
        InvalidRequestError: The path is relative (it would depend on the server's cwd), it
            leaves the checkpoint root, it is of the other kind (a URL under a directory
            root, a path under an ``s3://`` root, a URL with no root at all), or it holds a NUL
            character, which no path or object key may (D362).
    """
    if "\x00" in checkpoint_dir:
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir[:300]!r} holds a NUL character, which no path or "
            "object key may; nothing was read or written"
        )
    if is_object_store_url(checkpoint_dir) or (root is not None and is_object_store_url(root)):
        return _object_store_location(checkpoint_dir, root)
    path = Path(checkpoint_dir)
    if not path.is_absolute():
        raise InvalidRequestError(
            f"checkpoint_dir must be an absolute path, got {checkpoint_dir!r}"
        )
    if root is None:
        return path
    base = Path(os.path.realpath(root))
    resolved = Path(os.path.realpath(path))
    if resolved != base and base not in resolved.parents:
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir!r} is outside the checkpoint root {str(base)!r} "
            "(after resolving '..' and symlinks); nothing was read or written"
        )
    return resolved


def _object_store_location(checkpoint_dir: str, root: Path | str | None) -> str:
    if root is None:
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir[:300]!r} is an s3:// URL, but this server has no "
            "checkpoint root to confine it to; nothing was read or written"
        )
    if not is_object_store_url(checkpoint_dir):
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir[:300]!r} is not an s3:// URL, but the checkpoint "
            f"root {str(root)!r} is; nothing was read or written"
        )
    if not is_object_store_url(root):
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir[:300]!r} is an s3:// URL, but the checkpoint root "
            f"{str(root)!r} is a directory; nothing was read or written"
        )
    store = open_store(root)  # validated when the settings were made
    try:
        key = key_under(store, checkpoint_dir)
    except ValueError as exc:
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir[:300]!r} is outside the checkpoint root "
            f"{store.url!r} ({exc}); nothing was read or written"
        ) from None
    return f"{store.url}/{key}" if key else store.url


def participant_path(
    checkpoint_dir: str, *, root: Path | str | None, kind: str, instance: str
) -> tuple[ShareLocation, ShareLocation]:
    """The checkpoint location of a request and the participant's share inside it.

    Both are checked against the checkpoint root: a symlink below the checkpoint directory must
    not lead out of the root either. Both are paths, or both ``s3://`` URLs.

    Raises:
        InvalidRequestError: Either location is of the wrong kind or leaves the checkpoint root.
    """
    directory = checkpoint_path(checkpoint_dir, root)
    if isinstance(directory, Path):
        own = Path(participant_directory(directory, kind, instance))
        return directory, checkpoint_path(str(own), root)
    share = participant_directory(PurePosixPath(), kind, instance).as_posix()
    return directory, checkpoint_path(f"{directory}/{share}", root)
