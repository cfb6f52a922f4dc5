"""The process supervisor: the reference deployment as real server processes on 127.0.0.1.

Servers start one by one in ``ROLES`` order (worker, model, resources, agent, environment), each as
its own process group that binds port 0 and reports the port it got. After each one reports, the
cluster file is rewritten with its URL, so the servers started later find their peers. Every
wait is bounded. ``kill_all`` SIGKILLs every group (the crash of the drill); ``restart_all`` starts
fresh processes on the same run root. As a context manager it leaves no process behind on any exit
path, a ``KeyboardInterrupt`` included.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, Self

import httpx

from .._servers.cluster import DEFAULT_NAMES, ROLES, Cluster, Role, ServerEntry, write_cluster
from .._servers.context import CONTROL_TOKEN_ENV
from .spawn import ServerProcess

CLUSTER_FILE: Final = "cluster.toml"
LOGS_SUBDIR: Final = "logs"


@dataclass(frozen=True)
class ExtraServer:
    """A server beyond the one per role, started after them (a restart-only agent, say).

    Attributes:
        name: Its server name (the instance; unique in the cluster).
        role: Its role.
        options: Role options, passed as flags like ``SupervisorOptions.role_options``.
        peers: Role → the name of the server it must use for that role. Such a server reads its
            own view of the cluster file, with those peers listed first for their roles.
    """

    name: str
    role: Role
    options: Mapping[str, Any] = field(default_factory=dict)
    peers: Mapping[Role, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SupervisorOptions:
    """What to start and how long to wait.

    Attributes:
        roles: The roles to start (started in ``ROLES`` order whatever the order given).
        role_options: Role → options, passed as ``--<name-with-dashes> VALUE`` (booleans as
            ``--name`` / ``--no-name``) and recorded in the cluster file.
        startup_timeout: Seconds for a server to report its port.
        health_timeout: Seconds for a server's ``/healthz`` to answer 200.
        python: The interpreter that runs ``-m e2e serve``.
        env: Extra environment of every server (the drill's ``MIDFLIGHT_FAULT``, say).
        extra_servers: More servers, started in the given order after every role.
        checkpoint_root: Where the servers keep checkpoints: an ``s3://bucket/prefix`` URL, or
            (empty) the run root itself.
    """

    roles: tuple[Role, ...] = ROLES
    role_options: Mapping[Role, Mapping[str, Any]] = field(default_factory=dict)
    startup_timeout: float = 30.0
    health_timeout: float = 30.0
    python: str = sys.executable
    env: Mapping[str, str] = field(default_factory=dict)
    extra_servers: tuple[ExtraServer, ...] = ()
    checkpoint_root: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; known: {list(ROLES)}")


class LaunchedServer(Protocol):
    """One started server, however it is hosted."""

    url: str

    @property
    def pid(self) -> int:
        """The server's (main) process id."""
        ...

    def poll(self) -> int | None:
        """The exit code, or ``None`` while it runs."""
        ...

    def kill(self) -> None:
        """SIGKILL every process of the server and wait until they are gone."""
        ...


class ServerHost(Protocol):
    """Where the supervisor starts servers: processes here (:class:`LocalHost`), or Ray actors."""

    def launch(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        options: Mapping[str, Any],
        timeout: float,
    ) -> LaunchedServer:
        """Start the server ``argv`` (``["serve", role, …]``) and return once it listens."""
        ...


@dataclass(frozen=True)
class LocalHost:
    """Every server as a process group of its own on this machine (the default host)."""

    python: str = sys.executable

    def launch(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        options: Mapping[str, Any],
        timeout: float,
    ) -> LaunchedServer:
        return ServerProcess(
            [self.python, "-m", "e2e", *argv],
            env=env,
            log_path=log_path,
            startup_timeout=timeout,
        )


def option_flags(options: Mapping[str, Any]) -> list[str]:
    """Role options as command-line flags, in the given order."""
    flags: list[str] = []
    for key, value in options.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


class Supervisor:
    """Starts, kills and restarts the reference servers of one run root.

    Args:
        root: The run root (made absolute); logs go to ``<root>/logs/<name>-<n>.log`` where ``n``
            counts the starts, and the cluster file is ``<root>/cluster.toml``.
        token: The control token every server gets in ``MIDFLIGHT_CONTROL_TOKEN``.
        options: What to start; every role by default.
        host: Where the servers run: processes on this machine by default (with
            ``options.python``), or Ray actors (:class:`e2e._launch.ray_host.RayHost`).
    """

    def __init__(
        self,
        root: Path,
        token: str,
        options: SupervisorOptions | None = None,
        host: ServerHost | None = None,
    ) -> None:
        if not token:
            raise ValueError("the supervisor needs a non-empty control token")
        self.root = Path(root).resolve()
        self.token = token
        self.options = options or SupervisorOptions()
        self.cluster_path = self.root / CLUSTER_FILE
        self.checkpoint_root = self.options.checkpoint_root or str(self.root)
        self.generation = -1
        self.host: ServerHost = host or LocalHost(self.options.python)
        self.processes: dict[str, LaunchedServer] = {}
        self.started_pgids: list[int] = []
        self.urls: dict[str, str] = {}

    @property
    def roles(self) -> list[Role]:
        """The roles this supervisor starts, in start-up order."""
        return [role for role in ROLES if role in self.options.roles]

    def start_all(self) -> dict[str, str]:
        """Start every server in order; return server name → URL.

        On any failure every process started so far is killed before the error propagates.

        Raises:
            RuntimeError: Servers are already running (kill them first).
            TimeoutError: A server did not report its port or answer ``/healthz`` in time.
        """
        if self.processes:
            raise RuntimeError("servers are already running; kill_all() first")
        self.generation += 1
        (self.root / LOGS_SUBDIR).mkdir(parents=True, exist_ok=True)
        entries: list[ServerEntry] = []
        # A fresh file: a restarted server must never find its peers' dead URLs.
        write_cluster(
            self.cluster_path, Cluster(self.root, (), self.options.checkpoint_root or None)
        )
        try:
            for role in self.roles:
                entries.append(self._start(role))
                write_cluster(
                    self.cluster_path,
                    Cluster(self.root, tuple(entries), self.options.checkpoint_root or None),
                )
            for extra in self.options.extra_servers:
                view = self._peer_view(extra, entries)
                entries.append(self._start(extra.role, extra.name, extra.options, view))
                write_cluster(
                    self.cluster_path,
                    Cluster(self.root, tuple(entries), self.options.checkpoint_root or None),
                )
        except BaseException:
            self.kill_all()
            raise
        self.urls = {entry.name: entry.url for entry in entries}
        return dict(self.urls)

    def _peer_view(self, extra: ExtraServer, entries: list[ServerEntry]) -> Path:
        """The cluster as ``extra`` must see it: its chosen peers first for their roles."""
        chosen = set(extra.peers.values())
        missing = chosen - {entry.name for entry in entries}
        if missing:
            raise ValueError(f"{extra.name}: peers {sorted(missing)} are not started before it")
        first = [e for e in entries if e.name in chosen and extra.peers.get(e.role) == e.name]
        view = self.root / f"cluster-{extra.name}.toml"
        rest = [e for e in entries if e not in first]
        write_cluster(
            view, Cluster(self.root, tuple(first + rest), self.options.checkpoint_root or None)
        )
        return view

    def _start(
        self,
        role: Role,
        name: str | None = None,
        role_options: Mapping[str, Any] | None = None,
        cluster_view: Path | None = None,
    ) -> ServerEntry:
        name = name or DEFAULT_NAMES[role]
        if role_options is None:
            role_options = self.options.role_options.get(role, {})
        options = dict(role_options)
        argv = [
            "serve",
            role,
            "--port",
            "0",
            "--cluster",
            str(cluster_view or self.cluster_path),
            "--name",
            name,
            # The checkpoints of this run root are the only ones its servers may touch (D240).
            *([] if role == "worker" else ["--checkpoint-root", self.checkpoint_root]),
            *option_flags(options),
        ]
        process = self.host.launch(
            name,
            role,
            argv,
            {**self.options.env, CONTROL_TOKEN_ENV: self.token},
            self.root / LOGS_SUBDIR / f"{name}-{self.generation}.log",
            options,
            self.options.startup_timeout,
        )
        self.processes[name] = process
        self.started_pgids.append(process.pid)
        self._wait_healthy(name, process)
        return ServerEntry(name, role, process.url, options)

    def _wait_healthy(self, name: str, process: LaunchedServer) -> None:
        deadline = time.monotonic() + self.options.health_timeout
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if (code := process.poll()) is not None:
                    raise RuntimeError(f"{name} exited with code {code} before it was healthy")
                try:
                    reply = client.get(f"{process.url}/healthz")
                    if reply.status_code == 200:
                        return
                    last = f"HTTP {reply.status_code}"
                except httpx.TransportError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.05)
        raise TimeoutError(
            f"{name} at {process.url} was not healthy within {self.options.health_timeout:g} s "
            f"({last})"
        )

    def kill_all(self) -> None:
        """SIGKILL every server's process group and reap it; safe to call repeatedly."""
        errors: list[BaseException] = []
        while self.processes:
            _name, process = self.processes.popitem()
            try:
                process.kill()
            except Exception as exc:  # kill the others anyway, then report
                errors.append(exc)
        self.urls = {}
        if errors:
            raise RuntimeError(f"could not stop every server: {errors}")

    def restart_all(self) -> dict[str, str]:
        """Kill everything, then start fresh processes on the same run root."""
        self.kill_all()
        return self.start_all()

    def __enter__(self) -> Self:
        self.start_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill_all()
