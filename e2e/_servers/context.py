"""What a reference server needs to start: its name and port, the run root, its peers, its tokens.

The control token comes from ``MIDFLIGHT_CONTROL_TOKEN``; without it no control route is
installed. The capture token (ledger routes) comes from ``MIDFLIGHT_CAPTURE_TOKEN`` and defaults
to the control token. ``control_settings`` turns a context into the control plane's settings,
the drill's fault switches included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from participants import ControlSettings
from protocols import DEFAULT_LEASE_GRACE_SECONDS, is_object_store_url

from .cluster import Cluster, Role, default_cluster, read_cluster

HOST: Final = "127.0.0.1"
CONTROL_TOKEN_ENV: Final = "MIDFLIGHT_CONTROL_TOKEN"  # noqa: S105 - the variable name, not a token
CAPTURE_TOKEN_ENV: Final = "MIDFLIGHT_CAPTURE_TOKEN"  # noqa: S105 - the variable name, not a token
DEFAULT_ROOT: Final = Path("midflight-run")


@dataclass(frozen=True)
class ServeContext:
    """What a role needs to start: its name and port, the run root, its peers and tokens."""

    name: str
    port: int
    root: Path
    cluster: Cluster
    control_token: str | None
    capture_token: str | None
    processes: int = 1
    trace_dir: Path | None = None
    """``--processes``: how many shard processes serve behind the one port (1: no fan-out)."""
    checkpoint_root: Path | str | None = None
    """``--checkpoint-root``: a directory, or an ``s3://bucket/prefix`` URL (D330)."""

    @property
    def checkpoints_under(self) -> Path | str:
        """The checkpoint root: ``checkpoint_root`` when given (a URL as is), else the run root
        (D240)."""
        root = self.checkpoint_root
        if isinstance(root, str) and is_object_store_url(root):
            return root
        return Path(root or self.root).resolve()

    def peer_url(self, role: Role) -> str:
        """The URL of the peer of ``role`` (from the cluster file, else its default port)."""
        return self.cluster.url_of(role)


def serve_options_from(
    *,
    name: str,
    port: int,
    cluster: Path | None,
    root: Path | None,
    processes: int = 1,
    checkpoint_root: Path | str | None = None,
    trace_dir: Path | None = None,
) -> ServeContext:
    """Resolve the shared options of ``serve <role>``.

    ``checkpoint_root`` is a directory (resolved here) or an ``s3://bucket/prefix`` URL (kept).
    """
    parsed = read_cluster(cluster) if cluster is not None else None
    run_root = (root or (parsed.root if parsed else DEFAULT_ROOT)).resolve()
    control = os.environ.get(CONTROL_TOKEN_ENV) or None
    capture = os.environ.get(CAPTURE_TOKEN_ENV) or control
    return ServeContext(
        name=name,
        port=port,
        root=run_root,
        cluster=parsed if parsed is not None else default_cluster(run_root),
        control_token=control,
        capture_token=capture,
        processes=processes,
        checkpoint_root=_checkpoint_root(checkpoint_root),
        trace_dir=trace_dir,
    )


def _checkpoint_root(root: Path | str | None) -> Path | str | None:
    if root is None or (isinstance(root, str) and is_object_store_url(root)):
        return root
    return Path(root).resolve()


FAULT_ENV: Final = "MIDFLIGHT_FAULT"
LEASE_GRACE_ENV: Final = "MIDFLIGHT_LEASE_GRACE_SECONDS"
"""Test flag: a shorter lease grace, so a test can watch a lease expire (D157)."""


def active_fault() -> str | None:
    """The drill fault switch this server runs with (``MIDFLIGHT_FAULT``), if any."""
    return os.environ.get(FAULT_ENV) or None


def control_settings(ctx: ServeContext) -> ControlSettings:
    """The control-plane settings of a reference server (faults included).

    Commit and restore are confined to ``ctx.checkpoints_under`` (D240).
    """
    grace = os.environ.get(LEASE_GRACE_ENV)
    return ControlSettings(
        fence_on_restore=active_fault() != "no-restore-fence",
        lease_grace_seconds=float(grace) if grace else DEFAULT_LEASE_GRACE_SECONDS,
        checkpoint_root=ctx.checkpoints_under,
    )
