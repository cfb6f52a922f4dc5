"""The checkpoint store on a POSIX directory: rename, hard link and directory fsync (D327).

This is the layout midflight always wrote, byte for byte: a spooled file is fsynced in the
directory it is published to and renamed over its name; ``create`` links a synced temp file to
the name (a link never replaces one, so of two racing writers one wins); ``replace`` renames a
synced temp file over the name. Every new name is made durable by syncing its directory.
``replace_if`` holds an exclusive ``flock`` on the directory while it compares and renames, so
publishers in other processes are ordered too; no lock file is left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

from .durable import fsync_directory, make_directory_durable, write_file_durably
from .interface import ObjectMissingError, StoredObject, store_key

_READ_CHUNK: Final = 1 << 20


class PosixCheckpointStore:
    """A :class:`~protocols.CheckpointStore` on the directory ``root`` (created on first write)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def url(self) -> str:
        """The root directory, as given."""
        return str(self.root)

    def path(self, key: str) -> Path:
        """The file of ``key`` (the root itself for ``""``)."""
        return self.root / store_key(key) if key else self.root

    def describe(self, key: str) -> str:
        """The file's path."""
        return str(self.path(key))

    def exists(self, key: str) -> bool:
        """Whether a regular file has this key."""
        return self.path(key).is_file()

    def read(self, key: str) -> bytes:
        """The file's bytes."""
        path = self.path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError as exc:
            raise ObjectMissingError(f"{path} does not exist") from exc

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The file's bytes and their SHA-256 (its version); ``None`` when absent."""
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def lines(self, key: str) -> Iterator[bytes]:
        """The file's lines, read in 1 MiB chunks."""
        path = self.path(key)
        try:
            handle = open(path, "rb", buffering=_READ_CHUNK)  # noqa: SIM115 - closed below
        except FileNotFoundError as exc:
            raise ObjectMissingError(f"{path} does not exist") from exc
        with handle:
            yield from handle

    def spool_directory(self, prefix: str) -> Path:
        """The directory itself (created durably): the rename stays within one file system."""
        directory = self.path(prefix)
        make_directory_durable(directory)
        return directory

    def publish_file(self, key: str, source: Path) -> None:
        """Rename ``source`` over the name, then sync the directory."""
        path = self.path(key)
        os.replace(source, path)  # same name means same bytes: replacing a twin is harmless
        fsync_directory(path.parent)  # the name is durable before anything points at it

    def create(self, key: str, data: bytes) -> bool:
        """Link a synced temp file to the name; False when the name exists."""
        path = self.path(key)
        make_directory_durable(path.parent)
        fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        temp = Path(temp_name)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())  # the bytes are durable before the name is
            try:
                os.link(temp, path)  # never replaces an existing name: of two writers one wins
            except FileExistsError:
                return False
            fsync_directory(path.parent)  # the new name survives a power loss
            return True
        finally:
            temp.unlink(missing_ok=True)

    def replace(self, key: str, data: bytes) -> None:
        """Temp file, fsync, rename, directory fsync."""
        path = self.path(key)
        make_directory_durable(path.parent)
        write_file_durably(path, data)

    def replace_if(self, key: str, data: bytes, version: str | None) -> bool:
        """Compare and replace under an exclusive ``flock`` of the directory."""
        path = self.path(key)
        make_directory_durable(path.parent)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes
            current = self.read_versioned(key)
            if (None if current is None else current[1]) != version:
                return False
            write_file_durably(path, data)
            return True
        finally:
            os.close(fd)

    def list_objects(self, prefix: str) -> list[StoredObject]:
        """Every regular file below the prefix, symlinks and dot-files left out."""
        base = self.path(prefix)
        found: list[StoredObject] = []
        for directory, names, files in os.walk(base):
            names[:] = sorted(n for n in names if not n.startswith("."))
            for name in files:
                path = Path(directory) / name
                if name.startswith(".") or path.is_symlink():
                    continue
                stat = path.stat()
                key = path.relative_to(self.root).as_posix()
                found.append(StoredObject(key=key, size=stat.st_size, modified=stat.st_mtime))
        return sorted(found, key=lambda o: o.key)

    def subdirectories(self, prefix: str) -> list[str]:
        """Directories (not symlinks, not dot-names) directly below the prefix."""
        base = self.path(prefix)
        if not base.is_dir():
            return []
        return sorted(
            entry.name
            for entry in base.iterdir()
            if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(".")
        )

    def delete(self, keys: Iterable[str]) -> None:
        """Unlink the files, then sync each directory that lost one."""
        touched: set[Path] = set()
        for key in keys:
            path = self.path(key)
            path.unlink(missing_ok=True)
            touched.add(path.parent)
        for directory in touched:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: nothing to sync
                fsync_directory(directory)

    def delete_tree(self, prefix: str) -> None:
        """Remove the directory and everything in it, then sync its parent."""
        path = self.path(prefix)
        shutil.rmtree(path, ignore_errors=True)
        if path.parent.is_dir():
            fsync_directory(path.parent)  # the removal is final once the parent says so
