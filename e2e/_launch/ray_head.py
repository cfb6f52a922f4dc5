"""A local Ray head on 127.0.0.1 that dies with whoever started it, leaving no Ray process behind.

``ray start --head --block`` runs as its own process group, holding a lifeline (D242): however the
process that started it dies, the group is SIGKILLed, and the Ray workers, which lead groups of
their own, exit when their raylet goes. Every process of the head carries a marker in its
environment (:data:`MARKER_ENV`), so :meth:`RayHead.stop` can find and kill what is left, and a
test can check that nothing is (D337).

Ray runs on loopback only (its single-machine mode), with no dashboard, no usage reporting, a
bounded object store, its own temporary directory, and token authentication with a token made
for this head, passed in the environment and never written to ``~/.ray``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Self

from .lifeline import Lifeline
from .sockets import bind_listening_socket

MARKER_ENV: Final = "MIDFLIGHT_RAY_HEAD"
"""Carried by every process of one head (its id): how :func:`processes_of` finds them."""
OBJECT_STORE_BYTES: Final = 96 * 2**20
"""The object store of the drill's head: the servers pass nothing through it."""
START_TIMEOUT_S: Final = 90.0
_STARTED_LINE: Final = b"Ray runtime started"
_HEAD_MAIN: Final = (
    "from e2e._launch.lifeline import hold_lifeline; hold_lifeline(); "
    "from ray.scripts.scripts import main; main()"
)


def ray_environment(token: str) -> dict[str, str]:
    """What every process of a loopback Ray head needs, its drivers included.

    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's single-machine mode on every platform: the
    node address is 127.0.0.1 instead of the machine's outside address.
    """
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }


def _stat(proc: str) -> list[str] | None:
    """The fields of ``<proc>/stat`` after the command name (state first, then the parent)."""
    try:
        return Path(proc, "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(proc: str) -> str | None:
    fields = _stat(proc)
    return fields[0] if fields else None


def _parents() -> dict[int, list[int]]:
    """Process id → its children's ids, read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(entry.path)):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, …), read from ``/proc``."""
    children = _parents() if children is None else children
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            if is_running(child):
                found.append(child)
                queue.append(child)
    return found


def _belongs(proc: str, marker: bytes, temp_dir: str) -> bool:
    """Whether the process carries the head's marker, or writes its output into the head's
    directory (Ray's own processes rewrite their titles over their environment)."""
    try:
        if marker in Path(proc, "environ").read_bytes().split(b"\0"):
            return True
    except OSError:
        pass
    for fd in ("1", "2"):
        try:
            if os.readlink(Path(proc, "fd", fd)).startswith(temp_dir):
                return True
        except OSError:
            continue
    return False


def processes_of(head_id: str, temp_dir: Path) -> list[int]:
    """The live (not zombie) processes of one head, and every process below them."""
    marker = f"{MARKER_ENV}={head_id}".encode()
    prefix = f"{temp_dir}/"
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if _state(entry.path) not in (None, "Z", "X") and _belongs(entry.path, marker, prefix):
            found.add(int(entry.name))
    children = _parents()
    for pid in list(found):
        found.update(descendants(pid, children))
    return sorted(found)


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    return _state(f"/proc/{pid}") not in (None, "Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if is_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class RayHead:
    """One local Ray head, started by :meth:`start` and gone after :meth:`stop`.

    Args:
        num_cpus: The CPUs the head offers (the servers' actors ask for none by default).
        object_store_bytes: The object store's size.
        temp_dir: Ray's session files; a fresh directory under ``/tmp`` by default (Ray's unix
            socket paths must stay short), removed by :meth:`stop`.
        log_path: Where the head's own output goes; ``<temp_dir>/head.log`` when omitted.
    """

    def __init__(
        self,
        *,
        num_cpus: int = 2,
        object_store_bytes: int = OBJECT_STORE_BYTES,
        temp_dir: Path | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.head_id = secrets.token_hex(8)
        self.token = secrets.token_hex(32)  # Ray takes hex digits; other characters fail auth
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self._own_temp = temp_dir is None
        self.temp_dir = temp_dir or Path(tempfile.mkdtemp(prefix="mfray-", dir="/tmp"))
        self._log_file = log_path or self.temp_dir / "head.log"
        self.address = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self._log: IO[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a driver of this head needs in its environment (address, token, loopback)."""
        return {**ray_environment(self.token), "RAY_ADDRESS": self.address}

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Start the head; its address (``127.0.0.1:<port>``) once Ray says it runs.

        Raises:
            TimeoutError: Ray did not report it runs within ``timeout``.
            RuntimeError: ``ray start`` exited first.
        """
        with bind_listening_socket(0) as probe:  # a free port for the head's GCS
            port = probe.getsockname()[1]
        argv = [
            sys.executable,
            "-c",
            _HEAD_MAIN,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={self.temp_dir}",
        ]
        self._lifeline = Lifeline()
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self._log_file, "ab")  # noqa: SIM115
        env = {
            **os.environ,
            **ray_environment(self.token),
            MARKER_ENV: self.head_id,
            **self._lifeline.env,
        }
        env.pop("RAY_ADDRESS", None)
        try:
            self._process = subprocess.Popen(
                argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                pass_fds=self._lifeline.pass_fds,
            )
        finally:
            self._lifeline.started()
        try:
            self._wait_started(timeout)
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{port}"
        return self.address

    def _wait_started(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _STARTED_LINE in self._log_file.read_bytes():
                return
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with code {self._process.returncode}: "
                    f"{self._log_file.read_bytes()[-800:].decode(errors='replace')}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"the Ray head did not start within {timeout:g} s ({self._log_file})")

    def processes(self) -> list[int]:
        """Every live process of this head: Ray's own, its workers, and what they started."""
        return processes_of(self.head_id, self.temp_dir)

    def stop(self, timeout: float = 30.0) -> list[int]:
        """Kill every process of the head and remove its files; those still running after
        ``timeout`` (none, unless a process cannot be killed). Safe to call repeatedly."""
        before = self.processes()  # the marked head and all below it, while the tree holds
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
            if self._lifeline is not None:
                self._lifeline.cut()
            self._process.wait(timeout=timeout)
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        left = sorted({*before, *self.processes()})
        for pid in left:  # workers lead groups of their own: they go one by one
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        left = wait_gone(left, timeout)
        if self._own_temp:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def environment_of(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in this process's environment inside the block (a Ray driver reads it)."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


__all__ = [
    "MARKER_ENV",
    "RayHead",
    "descendants",
    "environment_of",
    "is_running",
    "processes_of",
    "wait_gone",
]
