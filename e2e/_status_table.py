"""The rows of ``midflight status``: one live status probe per participant server."""

from __future__ import annotations

import time
from typing import Any, Final

import anyio
from rich.table import Table

from coordinator import ControlClient, NotAParticipantError

from ._cluster import Cluster

PROBE_SECONDS: Final = 5.0
"""An operator waits this long for one server; a hung one shows as unreachable, not a hang."""
SHOWN_BLOCKERS: Final = 3
PARTICIPANT_ROLES: Final = ("environment", "model", "agent", "resources")


async def _row(name: str, url: str, token: str) -> dict[str, Any] | None:
    row: dict[str, Any] = {"server": name, "url": url}
    async with ControlClient(url, token=token, attempts=1) as client:
        try:
            status = await client.status(probe_seconds=PROBE_SECONDS)
        except NotAParticipantError:
            return None
        except Exception as exc:  # one broken server must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            return row
    lease = status.lease_expires_at
    row.update(
        kind=status.kind,
        instance=status.instance,
        phase=status.phase.value,
        checkpoint_id=status.checkpoint_id,
        lease_left_s=None if lease is None else round(max(0.0, lease - time.time()), 1),
        blocker_count=max(status.report.blocker_count, len(status.report.blockers)),
        blockers=list(status.report.blockers),
        counts=dict(status.report.counts),
        retired_rollouts=status.retired_rollouts,
    )
    return row


async def participant_rows(cluster: Cluster, token: str) -> list[dict[str, Any]]:
    """Probe every participant server of ``cluster`` at once; rows in file order."""
    servers = [s for s in cluster.servers if s.role in PARTICIPANT_ROLES]
    found: dict[int, dict[str, Any] | None] = {}

    async def one(index: int, name: str, url: str) -> None:
        found[index] = await _row(name, url, token)

    async with anyio.create_task_group() as group:
        for index, server in enumerate(servers):
            group.start_soon(one, index, server.name, server.url)
    return [row for _, row in sorted(found.items()) if row is not None]


def status_table(rows: list[dict[str, Any]]) -> Table:
    """The rich table of ``status``."""
    table = Table(title=f"midflight status ({time.strftime('%H:%M:%S')})")
    for column in ("server", "kind", "phase", "checkpoint", "lease", "blockers", "counts"):
        table.add_column(column)
    for row in rows:
        if "error" in row:
            table.add_row(row["server"], "?", "[red]unreachable[/red]", "", "", "", row["error"])
            continue
        blockers = ""
        if row["blocker_count"]:
            first = ", ".join(row["blockers"][:SHOWN_BLOCKERS])
            blockers = f"[yellow]{row['blocker_count']}[/yellow]: {first}"
        lease = "" if row["lease_left_s"] is None else f"{row['lease_left_s']} s"
        counts = " ".join(f"{k}={v}" for k, v in sorted(row["counts"].items()))
        table.add_row(
            f"{row['server']} ({row['instance']})",
            row["kind"],
            row["phase"],
            row["checkpoint_id"] or "",
            lease,
            blockers,
            counts,
        )
    return table
