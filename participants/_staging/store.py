"""A token staging store on local disk: single entries in files of their own, batches in segments.

``put`` writes one file per staging key, named by the SHA-256 of the key (keys hold ``/`` and may
be long); each file repeats its key, which ``get`` checks. It writes a temporary file, fsyncs it,
renames it over the name and fsyncs the directory.

``put_many`` is what a generation-cut round uses: it writes every entry of the batch into one
**segment** under ``segments/`` — one line per entry, ``<key as a JSON string> TAB <entry JSON>`` —
with the same four steps, so a batch costs two fsyncs however many entries it holds. Segment names
start with the writer's wall-clock nanoseconds, so sorting them orders the batches; a later
segment's entry for a key replaces an earlier one, and a line with an empty entry is a deletion
(a tombstone). A per-key file, when there is one, wins over any segment: ``put_many`` removes the
files of its keys once its segment is published.

Readers keep an in-memory index (key → segment, offset, length) and rescan ``segments/`` only when
it has changed: its modification time differs from the last scan, or is too recent to tell two
publications apart (another process of the same server may have published one since). The store
lives in its own directory, never the capture ledger's: the two have different owners and
lifetimes.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Final

from pydantic import TypeAdapter

from protocols import StagedEntry, TokenStagingStore

from .._storage.durable import fsync_directory, make_directory_durable, write_file_durably

ENTRY_SUFFIX: Final = ".staged.json"
SEGMENT_DIRECTORY: Final = "segments"
SEGMENT_SUFFIX: Final = ".segment.jsonl"
RESCAN_WINDOW_NS: Final = 2_000_000_000
"""A segment directory modified this recently is rescanned on every read: file times come from a
coarse clock, so two publications within one tick leave the same modification time."""
_ENTRY: Final[TypeAdapter[StagedEntry]] = TypeAdapter(StagedEntry)


@dataclass(frozen=True)
class _Slot:
    """Where a key's latest segment line sits (``length`` 0: deleted there)."""

    segment: str
    offset: int
    length: int


class FileTokenStagingStore:
    """A :class:`~protocols.TokenStagingStore` in one directory, with batched ``put_many``.

    Args:
        root: The directory; created (durably) when missing, with its ``segments/``.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.segments = self.root / SEGMENT_DIRECTORY
        make_directory_durable(self.segments)
        self._lock = threading.Lock()
        self._index: dict[str, _Slot] = {}
        self._scanned: set[str] = set()
        self._scanned_mtime_ns = -1
        self._prefix = f"{self.root}{os.sep}"

    def path_of(self, staging_key: str) -> Path:
        """The file that holds ``staging_key`` when it was stored by ``put``."""
        return Path(self._entry_path(staging_key))

    def _entry_path(self, staging_key: str) -> str:
        # A string, not a Path: a cut batch removes one name per key (D351).
        if not staging_key:
            raise ValueError("a staging key must be non-empty")
        name = hashlib.sha256(staging_key.encode("utf-8")).hexdigest()
        return f"{self._prefix}{name}{ENTRY_SUFFIX}"

    def put(self, entry: StagedEntry) -> None:
        """Store ``entry`` durably, replacing any entry under its key."""
        data = entry.model_dump_json().encode("utf-8")
        write_file_durably(self.path_of(entry.staging_key), data)

    def put_many(self, entries: Sequence[StagedEntry]) -> None:
        """Store every entry durably in one segment (two fsyncs), replacing entries of its keys.

        Raises:
            ValueError: Two entries share a key (nothing is written).
        """
        if not entries:
            return
        keys = [entry.staging_key for entry in entries]
        if len(set(keys)) != len(keys):
            raise ValueError("a batch may hold each staging key once")
        dump = _ENTRY.dump_json  # bytes, as ``model_dump_json`` would give them encoded
        lines = [_line(entry.staging_key, dump(entry)) for entry in entries]
        self._publish(lines, keys)
        replaced = False
        unlink, exists, entry_path = os.unlink, os.access, self._entry_path
        for key in keys:
            path = entry_path(key)
            # A cut key almost never has a file: asking costs half of a failed unlink (D417).
            if not exists(path, os.F_OK):
                continue
            try:
                unlink(path)
            except FileNotFoundError:
                continue  # another writer removed it first
            replaced = True
        if replaced:
            fsync_directory(self.root)  # the segment's entries must not be hidden after a crash

    def get(self, staging_key: str) -> StagedEntry | None:
        """The entry under ``staging_key``, its digests re-verified; ``None`` when absent.

        Raises:
            ValueError: The entry is corrupt, fails verification or holds another key.
        """
        data: bytes | None
        try:
            data = self.path_of(staging_key).read_bytes()
        except FileNotFoundError:
            data = self._segment_data(staging_key)
        if data is None:
            return None
        entry = StagedEntry.model_validate_json(data)
        if entry.staging_key != staging_key:
            raise ValueError(f"the entry for {staging_key!r} holds {entry.staging_key!r}")
        return entry

    def delete(self, staging_key: str) -> bool:
        """Remove the entry under ``staging_key`` durably; whether there was one."""
        try:
            os.unlink(self.path_of(staging_key))
        except FileNotFoundError:
            found = False
        else:
            found = True
            fsync_directory(self.root)  # the removal must survive a crash like the write did
        with self._lock:
            self._refresh_locked()
            slot = self._index.get(staging_key)
        if slot is not None and slot.length:
            self._publish([_line(staging_key, b"")], [staging_key])  # a tombstone
            found = True
        return found

    def keys(self) -> list[str]:
        """Every staged key, sorted (for inspection and tests; reads every file)."""
        found = set()
        for path in self.root.glob(f"*{ENTRY_SUFFIX}"):
            found.add(StagedEntry.model_validate_json(path.read_bytes()).staging_key)
        with self._lock:
            self._refresh_locked()
            found.update(key for key, slot in self._index.items() if slot.length)
        return sorted(found)

    def segment_names(self) -> list[str]:
        """The published segments, oldest first."""
        return sorted(p.name for p in self.segments.iterdir() if p.name.endswith(SEGMENT_SUFFIX))

    # -- segments -----------------------------------------------------------------------------

    def _publish(self, lines: list[bytes], keys: list[str]) -> None:
        name = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(4).hex()}{SEGMENT_SUFFIX}"
        write_file_durably(self.segments / name, b"".join(lines))
        with self._lock:
            offset = 0
            for key, line in zip(keys, lines, strict=True):
                head = line.index(b"\t") + 1
                body = len(line) - head - 1
                self._place(key, _Slot(name, offset + head, body))
                offset += len(line)
            self._scanned.add(name)

    def _place(self, key: str, slot: _Slot) -> None:
        held = self._index.get(key)
        if held is None or held.segment <= slot.segment:
            self._index[key] = slot

    def _segment_data(self, staging_key: str) -> bytes | None:
        with self._lock:
            self._refresh_locked()
            slot = self._index.get(staging_key)
        if slot is None or not slot.length:
            return None
        fd = os.open(self.segments / slot.segment, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, slot.length, slot.offset)
        finally:
            os.close(fd)
        if len(data) != slot.length:
            raise ValueError(f"the segment {slot.segment} is shorter than its index says")
        return data

    def _refresh_locked(self) -> None:
        """Index segments another process (or an earlier life of this one) published."""
        mtime = os.stat(self.segments).st_mtime_ns
        recent = time.time_ns() - mtime < RESCAN_WINDOW_NS
        if mtime == self._scanned_mtime_ns and not recent:
            return
        new = sorted(
            name
            for name in os.listdir(self.segments)
            if name.endswith(SEGMENT_SUFFIX) and name not in self._scanned
        )
        for name in new:
            for key, slot in _scan(self.segments / name):
                self._place(key, slot)
            self._scanned.add(name)
        self._scanned_mtime_ns = mtime


def _line(key: str, body: bytes) -> bytes:
    # ``json.dumps(key)`` of a string is exactly this, without its Python layers.
    return encode_basestring_ascii(key).encode("ascii") + b"\t" + body + b"\n"


def _scan(path: Path) -> Iterable[tuple[str, _Slot]]:
    """Every line of a published segment as (key, slot)."""
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        end = data.index(b"\n", offset)
        tab = data.index(b"\t", offset, end)
        key = json.loads(data[offset:tab])
        if not isinstance(key, str):
            raise ValueError(f"the segment {path.name} holds a line without a key")
        yield key, _Slot(path.name, tab + 1, end - tab - 1)
        offset = end + 1


def put_entries(store: TokenStagingStore, entries: Sequence[StagedEntry]) -> None:
    """Stage ``entries`` durably: in one batch when the store has ``put_many``, else one by one."""
    put_many = getattr(store, "put_many", None)
    if put_many is not None:
        put_many(entries)
        return
    for entry in entries:
        store.put(entry)
