"""One controller incarnation of a drill as its own process group, spoken to through its lines.

The drill, the kill -9 matrix and the random sequences each run their controller (``drill-driver``
or a suite's own) as a :class:`DriverProcess`: it reads the plan from a file, prints a line per
step, and dies with the drill, however the drill dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from .._launch.lifeline import Lifeline

ACTIVITY_POLL_S = 5.0
"""How often a silent phase looks at ``activity`` again."""


class DriverProcess:
    """One controller incarnation as its own process group, spoken to through stdout lines."""

    output_ended = False
    """Whether the controller closed its output (it ended, or is about to)."""
    silence = "it printed nothing"
    """What a stall means, for :meth:`why_it_stopped`."""

    def __init__(
        self,
        root: Path,
        cluster: Path,
        plan: dict[str, Any],
        env: dict[str, str],
        *,
        command: str = "drill-driver",
    ) -> None:
        plan_path = root / f"plan-{plan['phase']}.json"
        plan_path.write_text(json.dumps(plan))
        log = open(root / "logs" / f"driver-{plan['phase']}.log", "ab")  # noqa: SIM115
        self._log = log
        self.lifeline = Lifeline()  # the controller dies with the drill, however it dies (D242)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "e2e",
                command,
                "--root",
                str(root),
                "--cluster",
                str(cluster),
                "--plan",
                str(plan_path),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env, **self.lifeline.env},
            start_new_session=True,
            pass_fds=self.lifeline.pass_fds,
        )
        self.lifeline.started()
        self._buffer = b""

    def lines(self, timeout: float, on_line: Callable[[str], None]) -> Iterator[str]:
        """The lines the process prints (each passed to ``on_line`` first), until it closes its
        output or ``timeout`` passes; what follows the last line read stays buffered."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    text = line.decode(errors="replace").strip()
                    on_line(text)
                    yield text
                if not selector.select(remaining):
                    continue
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    self.output_ended = True
                    return
                self._buffer += chunk

    def wait_for(self, word: str, timeout: float, on_line: Callable[[str], None]) -> bool:
        """Read lines until one equals ``word`` (True) or the process ends or times out (False)."""
        return any(text == word for text in self.lines(timeout, on_line))

    def wait_for_progressing(
        self,
        word: str,
        stall: float,
        on_line: Callable[[str], None],
        activity: Callable[[], object] | None = None,
    ) -> bool:
        """:meth:`wait_for`, but ``stall`` bounds the silence, not the whole wait: a phase of a
        thousand rollouts may take long while it keeps moving.

        A line from the controller ends a silence, and so does a change in ``activity()`` (the
        servers' evidence growing, D375): with thousands in flight at once every rollout may be
        mid-episode for minutes, no rollout finishing and the controller printing nothing,
        while every model call still leaves its evidence line.
        """
        if activity is not None:
            self.silence = "it printed nothing and no server's evidence grew"
        quiet_since = time.monotonic()
        seen = activity() if activity is not None else None
        while (left := quiet_since + stall - time.monotonic()) > 0:
            poll = left if activity is None else min(left, ACTIVITY_POLL_S)
            for text in self.lines(poll, on_line):
                if text == word:
                    return True
                quiet_since = time.monotonic()  # a line came: a whole stall again
                break
            else:
                if self.output_ended:
                    return False  # the controller ended without the word
                if activity is not None and (now := activity()) != seen:
                    seen, quiet_since = now, time.monotonic()
        return False

    def why_it_stopped(self, stall: float) -> str:
        """Why :meth:`wait_for_progressing` gave up: the exit code and the last line of the
        controller's log when it exited, else the silence (a failure worth a line of its own)."""
        try:
            code: int | None = self.process.wait(timeout=2.0)  # its output ends just before it
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return f"{self.silence} for {stall:g} s"
        last = _last_line(Path(self._log.name))
        return f"it exited with code {code}" + (f", its log ending {last!r}" if last else "")

    def kill(self) -> None:
        """SIGKILL the controller's process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.lifeline.cut()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


_ERROR_LINE: Final = re.compile(r"^[\s|+]*((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b.*)$")
"""A traceback's last line (``OSError: [Errno 24] …``), with an exception group's ``| `` margin."""
_WORD: Final = re.compile(r"\w")


def _last_line(path: Path, tail: int = 4096) -> str:
    """What the end of ``path`` (its last ``tail`` bytes) says went wrong: the last line that
    names an error, else the last line with a word in it; ``""`` if none.

    A controller that dies of an exception group ends its log with the group's frame
    (``+------``); the error of its last sub-exception is the line a person needs (D387).
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - tail))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if found := _ERROR_LINE.match(line):
            return found.group(1).strip()[:300]
    return next((line.strip() for line in reversed(lines) if _WORD.search(line)), "")[:300]
