"""Where the fan-out's Unix socket lives: a private directory per start, cleaned up after a dead owner.

The main process makes a fresh 0700 directory, names itself in its ``owner`` file (pid and start
time), and listens on a 0600 socket inside it. A main process killed by SIGKILL never removes its
directory; the next start of a server of the same name does, once the owner is provably dead
(D243).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Final

import anyio
import structlog
from anyio.abc import SocketListener

SOCKET_OWNER_FILE: Final = "owner"
"""In a socket directory: ``<pid> <start time>`` of the process that made it (D243)."""
SOCKET_FILE: Final = "fanout.sock"
"""The socket's name inside its directory."""

_log = structlog.get_logger("midflight.fanout")


def _start_time(pid: int) -> str | None:
    """When ``pid`` started, in clock ticks since boot (Linux); ``None`` when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _owner_is_dead(owner: str) -> bool:
    try:
        pid_text, started = owner.split()
        pid = int(pid_text)
    except ValueError:
        return False  # not ours to judge: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, and someone else's
    now = _start_time(pid)
    if now is None:  # a zombie holds nothing; without /proc, os.kill's answer is all we have
        return Path("/proc/self/stat").exists()
    return started != "-" and now != started  # another start time: the pid was reused


def remove_stale_socket_dirs(name: str, *, base: Path | None = None) -> list[Path]:
    """Remove the socket directories of server ``name`` whose owner process is dead.

    A SIGKILLed main process never removes its directory; the next start of the same server does.
    Only directories of this user with an owner file naming a dead process are touched.

    Returns:
        The directories removed.
    """
    removed = []
    for directory in Path(base or tempfile.gettempdir()).glob(f"midflight-{name}-*"):
        try:
            if directory.is_symlink() or directory.stat().st_uid != os.getuid():
                continue
            owner = (directory / SOCKET_OWNER_FILE).read_text()
        except OSError:
            continue  # gone meanwhile, not a directory, or made before owner files existed
        if _owner_is_dead(owner):
            for entry in directory.iterdir():
                entry.unlink(missing_ok=True)
            directory.rmdir()
            removed.append(directory)
    if removed:
        _log.info("socket_dirs.removed", server=name, directories=[str(d) for d in removed])
    return removed


def private_socket_path(name: str, *, base: Path | None = None) -> Path:
    """A fresh socket path in a new 0700 directory, so only this user can reach it.

    Directories a dead main process of the same name left behind are removed first; the new one
    names this process as its owner.
    """
    remove_stale_socket_dirs(name, base=base)
    directory = Path(tempfile.mkdtemp(prefix=f"midflight-{name}-", dir=base))
    started = _start_time(os.getpid()) or "-"
    (directory / SOCKET_OWNER_FILE).write_text(f"{os.getpid()} {started}\n")
    return directory / SOCKET_FILE


async def listen_private(path: Path) -> SocketListener:
    """Listen on ``path`` and make the socket readable and writable by its owner only (0600)."""
    listener = await anyio.create_unix_listener(path)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    return listener
