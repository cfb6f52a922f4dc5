"""Every process the harness starts dies with the process that started it (D242).

A **lifeline** is a pipe per child: the child inherits the read end (its number travels in
``MIDFLIGHT_LIFELINE_FD``), the parent keeps the write end and never writes to it. However the
parent dies — SIGKILL, a test's timeout, an uncaught exception — the kernel closes the write end,
the child's read returns end-of-file, and the child SIGKILLs its own process group when it leads
one (a server and its shard processes), else itself. A pipe is per process, unlike Linux's
parent-death signal, which fires when the *thread* that forked exits (the tests start servers
from threads that come and go).

The harness commands also turn SIGTERM and SIGHUP into ``KeyboardInterrupt``, so they clean up
exactly as on Ctrl-C (:func:`terminate_as_interrupt`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Final

LIFELINE_ENV: Final = "MIDFLIGHT_LIFELINE_FD"
"""The file descriptor of the read end of the child's lifeline."""


class Lifeline:
    """The parent's side of one child's lifeline.

    Pass :attr:`env` and :attr:`pass_fds` to ``subprocess.Popen``, call :meth:`started` once the
    child runs, and :meth:`cut` to make the child die (closing it is all that is needed).
    """

    def __init__(self) -> None:
        # os.pipe() descriptors are not inheritable: no other child of ours gets either end.
        self._read: int | None
        self._read, self._write = os.pipe()
        self._cut = False

    @property
    def env(self) -> dict[str, str]:
        """The child's environment variable naming its end."""
        assert self._read is not None, "the child was already started"
        return {LIFELINE_ENV: str(self._read)}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """The descriptor the child must inherit."""
        assert self._read is not None, "the child was already started"
        return (self._read,)

    def started(self) -> None:
        """The child holds its end now; ours would only keep the pipe alive."""
        if self._read is not None:
            os.close(self._read)
            self._read = None

    def cut(self) -> None:
        """Close our end: the child kills itself (idempotent)."""
        self.started()
        if not self._cut:
            self._cut = True
            os.close(self._write)


def hold_lifeline() -> None:
    """In a child: die when the parent's end of the lifeline closes (no-op without one).

    The variable is removed from the environment, so a process this one starts never mistakes
    the number for a lifeline of its own.
    """
    named = os.environ.pop(LIFELINE_ENV, None)
    if named is None:
        return
    try:
        fd = int(named)
        os.fstat(fd)
    except (ValueError, OSError):
        return  # not ours to watch (a stale variable): run on
    os.set_inheritable(fd, False)
    threading.Thread(target=_wait_for_parent, args=(fd,), name="lifeline", daemon=True).start()


def _wait_for_parent(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    if os.getpgrp() == os.getpid():
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGKILL)  # the group: a server's shards with it
    os.kill(os.getpid(), signal.SIGKILL)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``KeyboardInterrupt`` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
