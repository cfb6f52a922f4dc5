"""The rows of ``midflight status``: one live status probe per participant server.

A row is one of three shapes: a participant's status; ``{"error": ...}`` for a server that did not
answer; ``{"control_routes": "disabled"}`` for a server that answers without control routes (it
was started without ``MIDFLIGHT_CONTROL_TOKEN``, so it takes no part in checkpoints).
"""

from __future__ import annotations

import time
from typing import Any, Final

import anyio
from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from coordinator import ControlClient, NotAParticipantError

from .._servers.cluster import PARTICIPANT_ROLES, Cluster

PROBE_SECONDS: Final = 5.0
"""An operator waits this long for one server; a hung one shows as unreachable, not a hang."""
SHOWN_BLOCKERS: Final = 3
CONTROL_DISABLED: Final = "control routes disabled"


async def _row(name: str, url: str, token: str) -> dict[str, Any]:
    row: dict[str, Any] = {"server": name, "url": url}
    async with ControlClient(url, token=token, attempts=1) as client:
        try:
            status = await client.status(probe_seconds=PROBE_SECONDS)
        except NotAParticipantError:
            row["control_routes"] = "disabled"
            return row
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
        restore_fences=int((status.model_extra or {}).get("restore_fences", 0)),
    )
    return row


async def participant_rows(cluster: Cluster, token: str) -> list[dict[str, Any]]:
    """Probe every participant server of ``cluster`` at once; rows in file order."""
    servers = [s for s in cluster.servers if s.role in PARTICIPANT_ROLES]
    found: dict[int, dict[str, Any]] = {}

    async def one(index: int, name: str, url: str) -> None:
        found[index] = await _row(name, url, token)

    async with anyio.create_task_group() as group:
        for index, server in enumerate(servers):
            group.start_soon(one, index, server.name, server.url)
    return [row for _, row in sorted(found.items())]


def answered(rows: list[dict[str, Any]]) -> int:
    """How many rows are a participant's status (reachable, control routes on)."""
    return sum(1 for row in rows if "phase" in row)


def status_table(rows: list[dict[str, Any]]) -> RenderableType:
    """The rich rendering of ``status``: the table, then one line per server without a status.

    Names, kinds (under the name, when it differs) and phases are never cut (they are what an operator reads
    first and types next); blockers and counts take one line each, and the checkpoint id folds. Errors go below
    the table, where a long message cannot squeeze it.
    """
    table = Table(title=f"midflight status ({time.strftime('%H:%M:%S')})", box=box.SIMPLE_HEAD)
    width = max([len("resources"), len("environment"), *(len(_name(row)) for row in rows)])
    table.add_column("server", no_wrap=True, min_width=width)
    table.add_column("phase", no_wrap=True, min_width=len("unreachable"))
    table.add_column("checkpoint", overflow="fold")
    table.add_column("blockers", overflow="fold")
    table.add_column("counts", overflow="fold")
    notes: list[Text] = []
    for row in rows:
        if "error" in row:
            table.add_row(row["server"], "[red]unreachable[/red]", "", "", "")
            notes.append(
                Text.from_markup(f"[red]{escape(row['server'])}[/red]: {escape(row['error'])}")
            )
            continue
        if "control_routes" in row:
            table.add_row(row["server"], "[yellow]no control[/yellow]", "", "", "")
            notes.append(
                Text.from_markup(
                    f"[yellow]{escape(row['server'])}[/yellow]: {CONTROL_DISABLED} (served "
                    "without MIDFLIGHT_CONTROL_TOKEN; it takes no part in checkpoints)"
                )
            )
            continue
        blockers = ""
        if row["blocker_count"]:
            first = "\n".join(escape(key) for key in row["blockers"][:SHOWN_BLOCKERS])
            more = row["blocker_count"] - min(SHOWN_BLOCKERS, len(row["blockers"]))
            blockers = f"[yellow]{row['blocker_count']}[/yellow]\n{first}"
            blockers += f"\n… {more} more" if more > 0 else ""
        phase = row["phase"]
        if row["lease_left_s"] is not None:
            phase += f"\nlease {row['lease_left_s']} s"
        marks = {"retired": row["retired_rollouts"], "fenced": row["restore_fences"]}
        shown = {**row["counts"], **{k: v for k, v in marks.items() if v}}
        counts = "\n".join(f"{k}={v}" for k, v in sorted(shown.items()))
        table.add_row(
            _name_and_kind(row),
            phase,
            escape(row["checkpoint_id"] or ""),
            blockers,
            counts,
        )
    if not rows:
        notes.append(Text("the cluster file lists no participant server"))
    elif not answered(rows):
        notes.append(Text.from_markup("[red]no participant answered[/red]"))
    return Group(table, *notes) if notes else table


def _name_and_kind(row: dict[str, Any]) -> str:
    name = escape(_name(row))
    return name if row["kind"] == row["server"] else f"{name}\n[dim]{row['kind']}[/dim]"


def _name(row: dict[str, Any]) -> str:
    instance = row.get("instance")
    return row["server"] if instance in (None, row["server"]) else f"{row['server']} ({instance})"
