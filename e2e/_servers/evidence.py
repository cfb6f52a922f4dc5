"""Append-only evidence logs that survive SIGKILL (e2e-contract §6).

Each writer appends one JSON line per event and fsyncs it before acting on it, so the drill computes
its figures from what really happened, never from in-memory counters.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from participants import fsync_directory, make_directory_durable


class EvidenceLog:
    """One append-only JSON-lines file, written by group commit.

    Appends from many threads at once share one ``write`` and one ``fsync``: the first caller to
    find no write under way writes every line queued so far, and each caller returns only once a
    sync covering its own line has finished (D386). A failed write or sync fails every append it
    carried, and only those.

    Args:
        path: The file; its directory is created durably when missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        make_directory_durable(self.path.parent)
        self._cond = threading.Condition()
        self._pending: list[bytes] = []
        self._queued = 0  # tickets handed out
        self._durable = 0  # every ticket up to this one is on disk
        self._failed: list[tuple[int, int, BaseException]] = []  # (after, through, error)
        self._writing = False

    def append(self, event: dict[str, Any]) -> None:
        """Append ``event`` as one line and fsync it (blocking: call from a worker thread).

        Raises:
            OSError: The write or sync that carried this line failed.
        """
        line = (json.dumps(event, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")
        with self._cond:
            self._pending.append(line)
            self._queued += 1
            ticket = self._queued
            while self._durable < ticket:
                if self._writing:
                    self._cond.wait()
                    continue
                batch, self._pending = self._pending, []
                first, through = self._durable, self._queued
                self._writing = True
                failure: BaseException | None = None
                self._cond.release()
                try:
                    self._write(b"".join(batch))
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    self._cond.acquire()
                    if failure is not None:
                        self._failed.append((first, through, failure))
                    self._writing = False
                    self._durable = through  # settled; a failed batch's lines raise below
                    self._cond.notify_all()
            for after, through, error in self._failed:
                if after < ticket <= through:
                    raise error

    def _write(self, data: bytes) -> None:
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)  # every event must be on disk before the server acts on it
        finally:
            os.close(fd)
        if created:
            fsync_directory(self.path.parent)  # a new file's name must survive a crash too

    def read(self) -> list[dict[str, Any]]:
        """Every event so far."""
        return read_evidence(self.path)


def read_evidence(path: Path) -> list[dict[str, Any]]:
    """Every event of an evidence file; a torn last line (a crash mid-write) is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def evidence_written(root: Path) -> int:
    """How many bytes of evidence the run under ``root`` has written so far, every server and
    controller together; it grows with each model call, dispatch and result (a drill's sign of
    life, D375). 0 before the first line."""
    total = 0
    try:
        with os.scandir(root / "evidence") as entries:
            for entry in entries:
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    continue  # removed between listing and looking
    except FileNotFoundError:
        return 0
    return total
