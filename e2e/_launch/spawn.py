"""Starting a server as its own process group on 127.0.0.1 and stopping it for sure.

A server binds its port itself (port 0 picks a free one) and announces ``listening on <url>``
on its first line of stdout; we read that line under a deadline. Every server runs in a new
session, so a SIGKILL of its group leaves no orphan behind, and holds a lifeline to this process,
so it dies with us however we die (D242).
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from .lifeline import Lifeline

_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """One server process group.

    Args:
        argv: The command line.
        env: Extra environment variables (added to ``os.environ``).
        log_path: Where the server's stderr goes; discarded when omitted.
        startup_timeout: Seconds to wait for the ``listening on`` line.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 30.0,
        cwd: Path | None = None,
    ) -> None:
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] | None = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self.argv = list(argv)
        self.lifeline = Lifeline()
        try:
            self.process = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=self._log if self._log is not None else subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {}), **self.lifeline.env},
                cwd=cwd,
                start_new_session=True,
                pass_fds=self.lifeline.pass_fds,
            )
        finally:
            self.lifeline.started()
        try:
            self.url = self._read_url(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _read_url(self, timeout: float) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        buffered = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                if not selector.select(remaining):
                    continue
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    break
                buffered += chunk
                match = _LISTENING.search(buffered.decode(errors="replace"))
                if match:
                    return match.group(1)
        raise TimeoutError(
            f"{' '.join(self.argv)} did not report 'listening on' within {timeout:g} s "
            f"(exit code {self.process.poll()}, output {buffered[-500:]!r})"
        )

    def poll(self) -> int | None:
        """The exit code, or ``None`` while it runs."""
        return self.process.poll()

    @property
    def pid(self) -> int:
        """The process id (also the process group id)."""
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it."""
        # Kill the group even when the leader is gone: a child of it may still hold the port.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.lifeline.cut()  # a shard process that left the group still goes
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
