"""Hosting the reference servers on Ray: one named actor per server, the server inside it.

The actor's own worker process is the server's process: it runs ``midflight serve <role> …`` in
a thread (uvicorn, or the main process of a server with several shard processes, whose shards are
its children and die with it through their lifelines). The HTTP interface, the control token and
``/healthz`` are those of a server in a process of its own (D336).

Ray carries no state across a crash: an actor is created with ``max_restarts=0`` and
``max_task_retries=0``, so a killed server stays dead and the checkpoint is the only way back.
A crash is a SIGKILL of every process the actor runs (the actor's worker and its shards); the
next start creates fresh actors under the same names.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from coordinator import DESCRIBE_METHOD

from .ray_head import descendants, environment_of, is_running, wait_gone

DEFAULT_ACTOR_OPTIONS: Final[Mapping[str, Any]] = {"num_cpus": 0}
"""A server's actor asks Ray for no CPU by default: the servers are I/O-bound, and seven of
them must fit a two-core head. Pass ``num_cpus``, ``resources`` or a scheduling strategy to
place them on a real cluster."""
KILL_TIMEOUT_S: Final = 30.0
NAME_RELEASE_TIMEOUT_S: Final = 30.0


class ServerActor:
    """The body of one server's actor (wrapped with ``ray.remote`` by :class:`RayHost`).

    Args:
        argv: The ``serve`` command line (``["serve", role, …]``).
        env: Environment variables of the server (its control token among them): passed as an
            argument, not as a Ray runtime environment, which Ray lists in its state API.
        log_path: The server's log; its stderr is redirected there.
        described: Its name, role and options, as :meth:`describe` answers them.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: str,
        described: Mapping[str, Any],
    ) -> None:
        os.environ.update(env)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)  # the server's structured log, as a process of its own writes it
        os.close(log)
        self._argv = list(argv)
        self._described = dict(described)
        self._url: str | None = None
        self._error: str | None = None
        self._ready = threading.Event()
        from .hosting import Hosting, host_in_this_process

        host_in_this_process(Hosting(argv=self._argv, announce=self._listening))
        threading.Thread(target=self._serve, name="midflight-serve", daemon=True).start()

    def _listening(self, url: str) -> None:
        self._url = url
        self._ready.set()

    def _serve(self) -> None:
        # What `python -m e2e serve …` runs, in this process: the command line is the argv.
        sys.argv = ["e2e", *self._argv]
        try:
            runpy.run_module("e2e", run_name="__main__", alter_sys=False)
            self._error = "the server returned"
        except BaseException as exc:  # reported by wait_listening, never swallowed silently
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()

    def wait_listening(self, timeout: float) -> dict[str, Any]:
        """The server's URL and this process's id, once it listens.

        Raises:
            TimeoutError: It did not listen within ``timeout``.
            RuntimeError: It exited first.
        """
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self._argv} did not listen within {timeout:g} s")
        if self._url is None:
            raise RuntimeError(f"{self._argv} exited before it listened: {self._error}")
        return {"url": self._url, "pid": os.getpid()}

    def describe(self) -> dict[str, Any]:
        """This server as a :class:`coordinator.HostedServer` (how the coordinator finds it)."""
        return {**self._described, "url": self._url or ""}

    def processes(self) -> list[int]:
        """This actor's process and every process below it (a server's shards)."""
        return [os.getpid(), *descendants(os.getpid())]


assert hasattr(ServerActor, DESCRIBE_METHOD)


class ActorServer:
    """One server hosted in a Ray actor, as the supervisor sees it."""

    def __init__(
        self,
        ray: Any,
        handle: Any,
        url: str,
        pid: int,
        name: str,
        on_killed: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._ray = ray
        self._on_killed = on_killed
        self.handle = handle
        self.url = url
        self.pid = pid
        self.name = name

    def poll(self) -> int | None:
        """``None`` while the actor's process runs, else ``-9``."""
        return None if is_running(self.pid) else -signal.SIGKILL

    def kill(self) -> None:
        """SIGKILL the actor's process and everything it started, wait until all are gone,
        and tell Ray the actor is dead for good (its name becomes free)."""
        pids = [self.pid, *descendants(self.pid)]
        if self._on_killed is not None:
            self._on_killed(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        left = wait_gone(pids, KILL_TIMEOUT_S)
        with contextlib.suppress(Exception):  # already dead: Ray may say so in its own words
            self._ray.kill(self.handle, no_restart=True)
        if left:
            raise RuntimeError(f"{self.name}: processes {left} survived SIGKILL")


class RayHost:
    """Starts each server as a named actor in ``namespace`` of a connected Ray.

    Connect with :meth:`connect` (or use it as a context manager) before the supervisor starts
    anything. Every process it kills is recorded in :attr:`killed`, one list per server kill.

    Args:
        address: The Ray head's address.
        env: The environment a driver of that head needs (:attr:`RayHead.env`).
        namespace: The Ray namespace of the servers' names (one per run).
        actor_options: Options of every actor beyond the defaults (``num_cpus``, ``resources``,
            ``scheduling_strategy``, …); ``max_restarts`` and ``max_task_retries`` stay 0.
    """

    def __init__(
        self,
        address: str,
        env: Mapping[str, str],
        namespace: str,
        actor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.address = address
        self.env = dict(env)
        self.namespace = namespace
        self.actor_options = {**DEFAULT_ACTOR_OPTIONS, **(actor_options or {})}
        self.killed: list[list[int]] = []
        self.started: list[int] = []
        self._ray: Any = None
        self._actor_class: Any = None
        self._environment: contextlib.ExitStack | None = None

    def connect(self) -> None:
        """Connect this process to the head as a Ray driver in :attr:`namespace`.

        Raises:
            RuntimeError: Ray was imported before, without the loopback environment: Ray reads
                it once, on import, and would look for the head at this machine's outside
                address.
        """
        already = "ray" in sys.modules
        self._environment = contextlib.ExitStack()
        self._environment.enter_context(environment_of(self.env))
        import ray
        from ray._private import ray_constants

        if already and ray_constants.ENABLE_RAY_CLUSTER:
            self._environment.close()
            raise RuntimeError(
                "ray was imported before RayHost.connect() without "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment; connect first"
            )
        ray.init(
            address=self.address,
            namespace=self.namespace,
            log_to_driver=False,
            logging_level="ERROR",
        )
        self._ray = ray
        self._actor_class = ray.remote(ServerActor)

    def disconnect(self) -> None:
        """Leave Ray (the actors this driver made die with its job)."""
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None
        if self._environment is not None:
            self._environment.close()
            self._environment = None

    def launch(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        options: Mapping[str, Any],
        timeout: float,
    ) -> ActorServer:
        """Create the server's actor under ``name`` and wait until the server listens.

        Raises:
            TimeoutError: The name stayed taken (a killed actor Ray had not buried yet), or the
                server did not listen within ``timeout``.
        """
        assert self._ray is not None, "connect() first"
        described = {"name": name, "role": role, "options": dict(options)}
        handle = self._create(name, list(argv), dict(env), str(log_path), described)
        try:
            listening = self._ray.get(handle.wait_listening.remote(timeout), timeout=timeout + 30)
        except BaseException:
            with contextlib.suppress(Exception):
                self._ray.kill(handle, no_restart=True)
            raise
        self.started.append(int(listening["pid"]))
        return ActorServer(
            self._ray, handle, listening["url"], int(listening["pid"]), name, self.killed.append
        )

    def _create(
        self, name: str, argv: list[str], env: dict[str, str], log: str, described: dict[str, Any]
    ) -> Any:
        from ray.exceptions import ActorAlreadyExistsError

        options = {
            **self.actor_options,
            "name": name,
            "namespace": self.namespace,
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": 4,  # wait_listening, describe and processes beside the server
        }
        deadline = time.monotonic() + NAME_RELEASE_TIMEOUT_S
        while True:
            try:
                return self._actor_class.options(**options).remote(argv, env, log, described)
            except (ActorAlreadyExistsError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the Ray actor name {name!r} stayed taken for {NAME_RELEASE_TIMEOUT_S:g} s"
                    ) from None
                time.sleep(0.1)

    def __enter__(self) -> RayHost:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()


__all__ = ["ActorServer", "RayHost", "ServerActor"]
