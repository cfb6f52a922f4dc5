"""Named kill points: where a test harness SIGKILLs a server or the controller on purpose.

The kill -9 matrix (``midflight drill --matrix``) needs each process to die at an exact
publication boundary, not wherever a timer happens to fire. So the process itself announces that
it reached the boundary — one fsynced JSON line in a file the harness watches — and then blocks
until the harness kills it.

Everything here is off unless the test flag is set: a kill point is armed only when
``MIDFLIGHT_TEST_HOOKS=1`` and ``MIDFLIGHT_KILL_POINT`` names this process. The spec is
``<process>:<boundary>[@<occurrence>]``: ``process`` is a server name (the participant
instance, e.g. ``policy`` for the reference model server) or ``controller``; the point fires on the ``occurrence``-th
time (default 1) a process of that name reaches ``boundary`` — counted in the file across
incarnations, so a restarted process goes on counting — and at most once per file, so the fresh
processes started after the kill run through it untouched.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import anyio

TEST_HOOKS_ENV: Final = "MIDFLIGHT_TEST_HOOKS"
KILL_POINT_ENV: Final = "MIDFLIGHT_KILL_POINT"
KILL_FILE_ENV: Final = "MIDFLIGHT_KILL_FILE"
KILL_BOUNDARIES: Final = (
    "prepare-sent",
    "some-prepared",
    "records-written",
    "manifests-published",
    "checkpoint-json-written",
    "resume-partly-sent",
    "retire-partly-applied",
)
"""Every boundary a process can be killed at, in the order a checkpoint reaches them."""
KILL_WAIT_SECONDS: Final = 300.0
"""How long a process waits at its kill point for the SIGKILL before it exits by itself."""
_NOT_KILLED_EXIT: Final = 70


class KillPoint:
    """One process's view of the armed kill point (inert unless the test flag is set).

    Args:
        process: This process's name: its server name, or ``controller``.
        environ: Where to read the flag and the spec (the process environment by default).

    Raises:
        ValueError: The flag is set and the spec names an unknown boundary or a bad occurrence.
    """

    def __init__(self, process: str, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.process = process
        self.boundary: str | None = None
        self.occurrence = 1
        self.file: Path | None = None
        self._lock = threading.Lock()
        spec = env.get(KILL_POINT_ENV, "")
        if env.get(TEST_HOOKS_ENV) != "1" or not spec or KILL_FILE_ENV not in env:
            return
        target, _, rest = spec.partition(":")
        boundary, _, occurrence = rest.partition("@")
        if boundary not in KILL_BOUNDARIES:
            raise ValueError(f"{KILL_POINT_ENV}={spec!r}: unknown boundary {boundary!r}")
        if occurrence and (not occurrence.isdigit() or int(occurrence) < 1):
            raise ValueError(f"{KILL_POINT_ENV}={spec!r}: the occurrence must be a positive int")
        if target != process:
            return
        self.boundary = boundary
        self.occurrence = int(occurrence or 1)
        self.file = Path(env[KILL_FILE_ENV])

    @property
    def armed(self) -> bool:
        """Whether this process has a kill point at all."""
        return self.boundary is not None

    def _due(self, boundary: str) -> bool:
        """Count a reach of ``boundary``; True when this is the one to die at."""
        if boundary != self.boundary:
            return False
        assert self.file is not None
        with self._lock:
            lines = _read_lines(self.file)
            if any(line.get("boundary") == boundary for line in lines):
                return False  # one kill per file: the processes restarted after it run through
            reached = 1 + sum(1 for line in lines if line.get("reached") == boundary)
            if reached < self.occurrence:
                self._append({"process": self.process, "reached": boundary, "t": time.time()})
                return False
            return True

    def _announce(self) -> None:
        assert self.boundary is not None
        self._append(
            {
                "process": self.process,
                "boundary": self.boundary,
                "occurrence": self.occurrence,
                "pid": os.getpid(),
                "t": time.time(),
            }
        )

    def _append(self, line: dict[str, object]) -> None:
        assert self.file is not None
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            # The harness kills on this line: it must be on disk before we stand still.
            os.fsync(handle.fileno())

    def reach(self, boundary: str) -> None:
        """Blocking form (worker threads, sync code): announce and wait for SIGKILL when due."""
        if not self._due(boundary):
            return
        self._announce()
        time.sleep(KILL_WAIT_SECONDS)
        os._exit(_NOT_KILLED_EXIT)  # nobody killed us: fail loudly rather than carry on

    async def areach(self, boundary: str) -> None:
        """Async form (event loop): announce in a worker thread and wait for SIGKILL when due."""
        if boundary != self.boundary:
            return
        if not await anyio.to_thread.run_sync(self._due, boundary):
            return
        await anyio.to_thread.run_sync(self._announce)
        await anyio.sleep(KILL_WAIT_SECONDS)
        os._exit(_NOT_KILLED_EXIT)  # nobody killed us: fail loudly rather than carry on


def _read_lines(path: Path) -> list[dict[str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines: list[dict[str, object]] = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by the very kill it announced
    return lines


def read_kill_announcements(path: Path) -> list[dict[str, object]]:
    """Every announcement (a process standing at its kill point) in a kill file, oldest first.

    Empty when the file does not exist; a torn last line is skipped.
    """
    return [line for line in _read_lines(path) if "boundary" in line]
