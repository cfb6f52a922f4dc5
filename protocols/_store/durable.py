"""Small durability primitives: directory fsync and durable directory creation.

A rename or hard link is only durable once the directory holding the new name is synced; a new
directory is only durable once its parent is synced. These helpers say so once, here.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed) to stable storage."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory_durable(directory: Path) -> None:
    """Create ``directory`` and any missing parents, syncing each parent that gained an entry.

    Without the parent syncs a power loss could forget a directory whose files were synced.
    """
    missing: list[Path] = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue  # another writer created it first; its parent sync covers it or ours will
        fsync_directory(path.parent)


def write_file_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, rename, directory fsync."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes must be on disk before the name points at them
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # makes the rename itself survive a power loss
