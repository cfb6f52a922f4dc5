"""What every control command shares: the cluster file, the token, the coordinator over the
cluster's participants, and one way to run an operation and report its failure (exit 1)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import anyio
import typer
from rich.markup import escape

from coordinator import CoordinationError, Coordinator, PublicationConflictError, discover
from protocols import EpisodeId, WireError

from .._servers.cluster import PARTICIPANT_ROLES, Cluster, read_cluster
from .._servers.context import CONTROL_TOKEN_ENV
from .output import emit, error_console, usage_error
from .status_table import CONTROL_DISABLED, participant_rows

T = TypeVar("T")
EXIT_FAILED: Final = 1
EXIT_BLOCKED: Final = 3
"""``checkpoint`` exit code when blockers remained (nothing published, everyone resumed)."""

ClusterOption = Annotated[
    Path, typer.Option("--cluster", help="The cluster file (TOML).", exists=True, dir_okay=False)
]
DeadlineOption = Annotated[
    float, typer.Option("--deadline", min=0.1, help="Seconds the operation may take.")
]


def control_token() -> str:
    token = os.environ.get(CONTROL_TOKEN_ENV, "")
    if not token:
        usage_error(f"set {CONTROL_TOKEN_ENV} to the control token")
    return token


def load_cluster(path: Path) -> Cluster:
    try:
        return read_cluster(path)
    except ValueError as exc:
        usage_error(str(exc))


def participant_urls(cluster: Cluster) -> list[str]:
    """URLs of every server of a participant role, in file order."""
    return [server.url for server in cluster.servers if server.role in PARTICIPANT_ROLES]


@asynccontextmanager
async def coordinator_over(cluster: Cluster, token: str) -> AsyncIterator[Coordinator]:
    try:
        members = await discover(participant_urls(cluster), token=token)
    except CoordinationError as exc:
        if "deployment" not in exc.failures:
            raise
        disabled = await _without_control_routes(cluster, token)
        if not disabled:
            raise
        detail = f"{exc.failures['deployment']}; {CONTROL_DISABLED} on {', '.join(disabled)}"
        raise CoordinationError("discover", {"deployment": detail}) from exc
    found = {member.url.rstrip("/") for member in members}
    for server in cluster.servers:
        if server.role in PARTICIPANT_ROLES and server.url.rstrip("/") not in found:
            # A listed participant that answers without control routes is left out: say so.
            error_console.print(
                f"[yellow]warning[/yellow]: {escape(server.name)}: {CONTROL_DISABLED} (served "
                f"without {CONTROL_TOKEN_ENV}); it takes no part",
                soft_wrap=True,
            )
    async with Coordinator(members) as coordinator:
        yield coordinator


async def _without_control_routes(cluster: Cluster, token: str) -> list[str]:
    rows = await participant_rows(cluster, token)
    return [row["server"] for row in rows if row.get("control_routes") == "disabled"]


def run_operation(what: str, as_json: bool, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``work`` with a spinner; a coordination failure becomes a precise message and exit 1."""
    spinner = error_console.status(what, spinner="dots") if not as_json else nullcontext()
    try:
        with spinner:
            return anyio.run(work)
    except (CoordinationError, WireError, PublicationConflictError, OSError) as exc:
        # OSError: the checkpoint store failed (protocols.StoreError), not a participant
        failures = getattr(exc, "failures", {})
        message = str(exc)
        payload = {"ok": False, "error": message, "failures": failures}
        emit(
            payload,
            as_json=as_json,
            render=lambda: error_console.print(f"[red]failed[/red]: {message}"),
        )
        raise typer.Exit(EXIT_FAILED) from None


def episodes_of(keys: list[str]) -> list[EpisodeId]:
    try:
        return [EpisodeId.from_capture_key(key) for key in keys]
    except (WireError, ValueError) as exc:
        usage_error(str(exc))


def read_scope(path: Path | None) -> list[EpisodeId] | None:
    if path is None:
        return None
    try:
        keys = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        usage_error(f"cannot read scope file {path}: {exc}")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        usage_error(f"{path}: the scope is a JSON array of capture keys")
    return episodes_of(keys)
