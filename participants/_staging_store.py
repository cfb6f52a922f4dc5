"""A token staging store on local disk: one file per staging key, durable before ``put`` returns.

Files are named by the SHA-256 of their staging key (keys hold ``/`` and may be long), and each
file repeats its key, which ``get`` checks. A ``put`` writes a temporary file, fsyncs it, renames
it over the name and fsyncs the directory. The store lives in its own directory, never the capture
ledger's: the two have different owners and lifetimes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

from protocols import StagedEntry

from ._durable import fsync_directory, make_directory_durable, write_file_durably

ENTRY_SUFFIX: Final = ".staged.json"


class FileTokenStagingStore:
    """A :class:`~protocols.TokenStagingStore` in one directory.

    Args:
        root: The directory; created (durably) when missing.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        make_directory_durable(self.root)

    def path_of(self, staging_key: str) -> Path:
        """The file that holds ``staging_key``."""
        if not staging_key:
            raise ValueError("a staging key must be non-empty")
        name = hashlib.sha256(staging_key.encode("utf-8")).hexdigest()
        return self.root / f"{name}{ENTRY_SUFFIX}"

    def put(self, entry: StagedEntry) -> None:
        """Store ``entry`` durably, replacing any entry under its key."""
        data = entry.model_dump_json().encode("utf-8")
        write_file_durably(self.path_of(entry.staging_key), data)

    def get(self, staging_key: str) -> StagedEntry | None:
        """The entry under ``staging_key``, its digests re-verified; ``None`` when absent.

        Raises:
            ValueError: The file is corrupt, fails verification or holds another key.
        """
        try:
            data = self.path_of(staging_key).read_bytes()
        except FileNotFoundError:
            return None
        entry = StagedEntry.model_validate_json(data)
        if entry.staging_key != staging_key:
            raise ValueError(f"the file for {staging_key!r} holds {entry.staging_key!r}")
        return entry

    def delete(self, staging_key: str) -> bool:
        """Remove the entry under ``staging_key`` durably; whether there was one."""
        try:
            os.unlink(self.path_of(staging_key))
        except FileNotFoundError:
            return False
        fsync_directory(self.root)  # the removal must survive a crash like the write did
        return True

    def keys(self) -> list[str]:
        """Every staged key, sorted (for inspection and tests; reads every file)."""
        found = []
        for path in self.root.glob(f"*{ENTRY_SUFFIX}"):
            found.append(StagedEntry.model_validate_json(path.read_bytes()).staging_key)
        return sorted(found)
