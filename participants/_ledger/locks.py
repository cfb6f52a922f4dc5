"""Striped locks for the capture ledger, exclusive across threads and processes.

A per-rollout lock file could never be deleted safely (another process may be waiting on it), so
every process sharing a ledger directory locks one of a fixed set of stripe files, created once
and never removed. A key's stripe comes from a CRC-32 of the key — the same in every process,
unlike Python's salted ``hash``. Inside a process a ``threading.Lock`` per stripe comes first:
``flock`` belongs to the open file description, so two threads sharing one descriptor would not
exclude each other through it alone.
"""

from __future__ import annotations

import fcntl
import os
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

LOCK_DIRECTORY: Final = ".ledger-locks"
DEFAULT_STRIPES: Final = 64


def stripe_of(key: str, stripes: int) -> int:
    """The stripe index of ``key``: stable across processes and runs."""
    return zlib.crc32(key.encode()) % stripes


class StripedThreadLocks:
    """Striped thread locks: the in-memory ledger's locks, and the first half of the file ones."""

    def __init__(self, stripes: int = DEFAULT_STRIPES) -> None:
        if stripes < 1:
            raise ValueError("stripes must be at least 1")
        self.stripes = stripes
        self._thread_locks = [threading.Lock() for _ in range(stripes)]

    def stripe(self, key: str) -> int:
        """The stripe index of ``key``."""
        return stripe_of(key, self.stripes)

    @contextmanager
    def hold_stripe(self, index: int) -> Iterator[None]:
        """Hold stripe ``index`` against other threads."""
        with self._thread_locks[index]:
            yield

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Hold the stripe of ``key``."""
        with self.hold_stripe(self.stripe(key)):
            yield

    def by_stripe(self, keys: Iterable[str]) -> dict[int, list[str]]:
        """Group keys by stripe, keeping their order, so a batch locks each stripe once."""
        groups: dict[int, list[str]] = {}
        for key in keys:
            groups.setdefault(self.stripe(key), []).append(key)
        return groups


class StripedFileLocks(StripedThreadLocks):
    """A fixed set of stripe lock files under ``<root>/.ledger-locks``.

    Args:
        root: The ledger directory.
        stripes: How many stripe files; every process sharing the directory must use the same
            number.
    """

    def __init__(self, root: Path, stripes: int = DEFAULT_STRIPES) -> None:
        super().__init__(stripes)
        self.directory = Path(root) / LOCK_DIRECTORY
        self.directory.mkdir(exist_ok=True)
        self._fds: list[int] = []
        for index in range(stripes):
            # O_CREAT without O_EXCL: every process opens the same files; nobody deletes them.
            path = self.directory / f"stripe-{index:03d}.lock"
            self._fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))

    @contextmanager
    def hold_stripe(self, index: int) -> Iterator[None]:
        """Hold stripe ``index`` exclusively against every thread and process."""
        with self._thread_locks[index]:
            fd = self._fds[index]
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def acquire(self, key: str) -> int:
        """Take the stripe of ``key`` like ``hold``, without a context manager; returns it.

        The append path is hot enough that two nested generator-based context managers cost
        about a fifth of its CPU time; pair every call with ``release`` in a ``finally``.
        """
        index = zlib.crc32(key.encode()) % self.stripes
        self._thread_locks[index].acquire()
        try:
            fcntl.flock(self._fds[index], fcntl.LOCK_EX)
        except BaseException:
            self._thread_locks[index].release()
            raise
        return index

    def release(self, index: int) -> None:
        """Release a stripe taken with ``acquire``."""
        try:
            fcntl.flock(self._fds[index], fcntl.LOCK_UN)
        finally:
            self._thread_locks[index].release()

    def close(self) -> None:
        """Close the stripe descriptors (the files stay)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
