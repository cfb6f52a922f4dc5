"""``--on local|ray``: where the drill's servers run.

``local`` (the default) starts each server as a process group of its own. ``ray`` starts a
local Ray head on 127.0.0.1 for the whole drill (baseline and run), hosts every server in a
named actor of a namespace per cluster, and crashes by SIGKILLing every process those actors
run; the drill's controller discovers the servers from Ray. The head goes on every exit path,
and the figures say how many processes each crash killed and how many outlived the head (D339).
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ON_CHOICES: Final = ("local", "ray")
RAY_NAMESPACE_ENV: Final = "MIDFLIGHT_RAY_NAMESPACE"
"""Tells the drill's controller to discover the servers from this Ray namespace."""


def ray_available() -> bool:
    """Whether Ray is installed (the ``ray`` extra)."""
    import importlib.util

    return importlib.util.find_spec("ray") is not None


@dataclass
class ClusterHosting:
    """Where one cluster (the baseline's, or the run's) runs: what the supervisor and the
    controller need."""

    host: Any = None
    """A :class:`~e2e._launch.supervisor.ServerHost`; ``None`` for local processes."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the controller (Ray's address and token, the namespace)."""
    kills: list[list[int]] = field(default_factory=list)
    """Per crash: every process it killed (Ray hosting only)."""

    def crashed(self) -> None:
        """Note the processes the crash just killed."""
        if self.host is not None:
            killed = self.host.killed
            self.kills.append(sorted(pid for pids in killed for pid in pids))
            killed.clear()


@dataclass
class DrillHosting:
    """The drill's hosting: nothing for ``local``, a Ray head for ``ray``."""

    on: str
    work: Path
    head: Any = None
    clusters: list[ClusterHosting] = field(default_factory=list)
    left_running: int = 0

    @contextlib.contextmanager
    def cluster(self, root: Path) -> Iterator[ClusterHosting]:
        """The hosting of the cluster in ``root`` (connected to Ray while inside)."""
        if self.head is None:
            yield ClusterHosting()
            return
        from .._launch.ray_host import RayHost

        namespace = f"midflight-{root.name}-{secrets.token_hex(4)}"
        with RayHost(self.head.address, self.head.env, namespace) as host:
            hosting = ClusterHosting(host=host, env={**self.head.env, RAY_NAMESPACE_ENV: namespace})
            self.clusters.append(hosting)
            yield hosting

    def figures(self) -> dict[str, Any]:
        """``on``, and on Ray the processes each crash of the run killed, those left, and which
        head it was (its marker and directory, to look for its processes afterwards)."""
        if self.head is None:  # every error figure is in every result, so a script can read it
            return {"on": self.on, "ray_left_running": 0}
        run = self.clusters[-1] if self.clusters else ClusterHosting()
        return {
            "on": self.on,
            "ray_processes_killed": [len(pids) for pids in run.kills],
            "ray_left_running": self.left_running,
            "ray_head": {"id": self.head.head_id, "temp_dir": str(self.head.temp_dir)},
        }


@contextlib.contextmanager
def drill_hosting(on: str, work: Path, on_line: Any) -> Iterator[DrillHosting]:
    """Start what ``on`` needs; on every exit path stop it and count what outlived it."""
    hosting = DrillHosting(on, work)
    if on != "ray":
        yield hosting
        return
    from .._launch.ray_head import RayHead

    head = RayHead(log_path=work / "logs" / "ray-head.log")
    # A Ray driver prints the raylet's notices (a worker died, …) on stdout; stdout carries only
    # the drill's result (its JSON), so they go to stderr with the progress.
    with contextlib.redirect_stdout(sys.stderr), _stopping(head, hosting):
        head.start()
        on_line(f"servers hosted on a local Ray head at {head.address}")
        hosting.head = head
        yield hosting


@contextlib.contextmanager
def _stopping(head: Any, hosting: DrillHosting) -> Iterator[None]:
    try:
        yield
    finally:
        hosting.left_running = len(head.stop())


__all__ = ["ON_CHOICES", "RAY_NAMESPACE_ENV", "DrillHosting", "drill_hosting", "ray_available"]
