"""Named kill points: where a test harness SIGKILLs a server or the controller on purpose.

The kill -9 matrix (``midflight drill --matrix``) needs each process to die at an exact
publication boundary, not wherever a timer happens to fire. So the process itself announces that
it reached the boundary — one fsynced JSON line in a file the harness watches — and then blocks
until the harness kills it.

Everything here is off unless the test flag is set: a kill point is armed only when
``MIDFLIGHT_TEST_HOOKS=1`` and ``MIDFLIGHT_KILL_POINT`` names this process. The spec is
``<process>:<boundary>[@<occurrence>]``: ``process`` is a server name (``environment``,
``model``, ``agent``, ``resources``) or ``controller``; the point fires on the ``occurrence``-th
time (default 1) this process reaches ``boundary``, and at most once per announcement file, so
the fresh processes started after the kill run through it untouched.
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
        self._reached = 0
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
        with self._lock:
            self._reached += 1
            return self._reached == self.occurrence and not self._already_announced()

    def _already_announced(self) -> bool:
        # One kill per announcement file: the processes restarted after it must run through.
        assert self.file is not None
        return any(a.get("boundary") == self.boundary for a in read_kill_announcements(self.file))

    def _announce(self) -> None:
        assert self.file is not None
        assert self.boundary is not None
        line = {
            "process": self.process,
            "boundary": self.boundary,
            "occurrence": self.occurrence,
            "pid": os.getpid(),
            "t": time.time(),
        }
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


def read_kill_announcements(path: Path) -> list[dict[str, object]]:
    """Every announcement in a kill file (empty when none), skipping a torn last line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    announcements: list[dict[str, object]] = []
    for line in text.splitlines():
        try:
            announcements.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by the very kill it announced
    return announcements
