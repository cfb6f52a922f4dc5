"""Socket directories of the fan-out channel: private, and cleaned up after a dead owner (D243)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from participants import SOCKET_OWNER_FILE, private_socket_path
from participants._fanout.sockets import remove_stale_socket_dirs


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _left_behind(base: Path, name: str, owner: str, suffix: str = "abcd1234") -> Path:
    directory = base / f"midflight-{name}-{suffix}"
    directory.mkdir(mode=0o700)
    (directory / "fanout.sock").write_text("")
    (directory / SOCKET_OWNER_FILE).write_text(owner)
    return directory


def test_a_new_socket_dir_names_its_owner_and_is_private(tmp_path: Path) -> None:
    path = private_socket_path("srv", base=tmp_path)
    assert path.parent.stat().st_mode & 0o777 == 0o700
    pid, started = (path.parent / SOCKET_OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid() and started != "-"


def test_the_next_start_removes_only_what_a_dead_owner_left(tmp_path: Path) -> None:
    dead = _left_behind(tmp_path, "srv", f"{_dead_pid()} 1")
    mine = private_socket_path("srv", base=tmp_path).parent  # alive: this process
    started = (mine / SOCKET_OWNER_FILE).read_text().split()[1]
    reused = _left_behind(
        tmp_path, "srv", f"{os.getpid()} {int(started) + 1}", "reused"
    )  # pid reused
    legacy = tmp_path / "midflight-srv-legacy"  # no owner file: cannot tell, left alone
    legacy.mkdir()
    other = _left_behind(tmp_path, "other", f"{_dead_pid()} 1")  # another server's
    assert not dead.exists()  # removed when `mine` was made
    assert remove_stale_socket_dirs("srv", base=tmp_path) == [reused]
    assert mine.exists() and legacy.exists() and other.exists()
