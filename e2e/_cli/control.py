"""The operator's control commands over a cluster file: status, checkpoint, restore, resume, retire,
forget.

``checkpoint`` and ``restore`` keep checkpoints under the cluster file's ``checkpoint_store`` when
it names one (an ``s3://`` URL), else under its ``root``.

The control token comes from ``MIDFLIGHT_CONTROL_TOKEN``. Every command takes ``--json``; long
operations show a progress spinner on stderr (never on stdout, which ``--json`` owns).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
from rich.live import Live

from coordinator import (
    checkpoint,
    checkpoint_location,
    read_checkpoint,
    read_latest,
)
from protocols import WireError, validate_rollout_ids

from .._servers.cluster import Cluster
from .control_session import (
    EXIT_BLOCKED,
    EXIT_FAILED,
    ClusterOption,
    DeadlineOption,
    control_token,
    coordinator_over,
    episodes_of,
    load_cluster,
    read_scope,
    run_operation,
)
from .locations import store_failed
from .output import JsonOption, console, counted, emit, usage_error
from .status_table import answered, participant_rows, status_table


def _watch_json(cluster: Cluster, token: str, every: float, rows: list[dict[str, Any]]) -> None:
    """``status --watch S --json``: one JSON object per line, every S seconds, until Ctrl-C."""
    try:
        while True:
            payload = {"participants": rows, "answered": answered(rows), "t": time.time()}
            emit(payload, as_json=True, render=lambda: None)
            time.sleep(every)
            rows = anyio.run(participant_rows, cluster, token)
    except KeyboardInterrupt:
        return


def register(app: typer.Typer) -> None:
    """Add the control commands to the app."""

    @app.command("status")
    def status_command(
        cluster: ClusterOption,
        watch: Annotated[
            float,
            typer.Option(
                "--watch",
                min=0.0,
                help="Refresh every N seconds until Ctrl-C (0: once); with --json, one JSON "
                "object per line per refresh.",
            ),
        ] = 0.0,
        as_json: JsonOption = False,
    ) -> None:
        """One row per participant: phase, checkpoint, lease, blockers, counts.

        Exits 1 when no participant answered (every server unreachable or without control
        routes), else 0.
        """
        servers = load_cluster(cluster)
        token = control_token()
        rows = anyio.run(participant_rows, servers, token)
        if watch <= 0:
            emit(
                {"participants": rows, "answered": answered(rows)},
                as_json=as_json,
                render=lambda: console.print(status_table(rows)),
            )
            raise typer.Exit(0 if answered(rows) else EXIT_FAILED)
        if as_json:
            _watch_json(servers, token, watch, rows)
            return
        with Live(status_table(rows), console=console, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(watch)
                    live.update(status_table(anyio.run(participant_rows, servers, token)))
            except KeyboardInterrupt:
                return

    @app.command("checkpoint")
    def checkpoint_command(
        cluster: ClusterOption,
        scope: Annotated[
            Path | None, typer.Option("--scope", help="JSON array of capture keys to continue.")
        ] = None,
        checkpoint_id: Annotated[str | None, typer.Option("--id", help="Checkpoint id.")] = None,
        deadline: DeadlineOption = 60.0,
        as_json: JsonOption = False,
    ) -> None:
        """Prepare, commit, publish and resume; report blockers when some remain."""
        servers = load_cluster(cluster)
        token = control_token()
        episodes = read_scope(scope)
        chosen = checkpoint_id or f"ckpt-{int(time.time() * 1000)}"

        async def work() -> Any:
            async with coordinator_over(servers, token) as coordinator:
                return await checkpoint(
                    coordinator,
                    servers.store_root,
                    chosen,
                    deadline_seconds=deadline,
                    episodes=episodes,
                )

        outcome = run_operation(f"checkpoint {chosen}…", as_json, work)
        payload = {
            "ok": outcome.published,
            "checkpoint_id": chosen,
            "published": outcome.published,
            "checkpoint_dir": checkpoint_location(servers.store_root, chosen),
            "blockers": outcome.prepare.blockers(),
            "blocking_episodes": [e.capture_key for e in outcome.blocking_episodes()],
            "restarts": sorted(e.capture_key for e in outcome.prepare.restarts()),
            "continued": [e.capture_key for e in outcome.manifest.continued]
            if outcome.manifest
            else [],
        }

        def render() -> None:
            if outcome.published:
                console.print(
                    f"[green]published[/green] {chosen}: {len(payload['continued'])} continued, "
                    f"{len(payload['restarts'])} restart"
                )
                return
            console.print(f"[yellow]blocked[/yellow] {chosen}: nothing published, all resumed")
            for name, keys in payload["blockers"].items():
                console.print(f"  {name}: {', '.join(keys)}")

        emit(payload, as_json=as_json, render=render)
        raise typer.Exit(0 if outcome.published else EXIT_BLOCKED)

    @app.command("restore")
    def restore_command(
        cluster: ClusterOption,
        source: Annotated[
            str | None, typer.Option("--checkpoint", help="Checkpoint to restore (LATEST).")
        ] = None,
        resume: Annotated[bool, typer.Option(help="Resume everyone afterwards.")] = True,
        deadline: DeadlineOption = 60.0,
        as_json: JsonOption = False,
    ) -> None:
        """Restore a published checkpoint everywhere, all or nothing."""
        servers = load_cluster(cluster)
        token = control_token()
        store_root = servers.store_root
        try:
            manifest = read_checkpoint(store_root, source) if source else read_latest(store_root)
        except (WireError, ValueError) as exc:
            usage_error(str(exc))
        except OSError as exc:
            store_failed(exc)
        if manifest is None:
            usage_error(f"nothing is published under {store_root}")
        operation = f"restore-{int(time.time() * 1000)}"
        directory = checkpoint_location(store_root, manifest.checkpoint_id)

        async def work() -> list[str]:
            async with coordinator_over(servers, token) as coordinator:
                replies = await coordinator.restore(
                    operation, time.time() + deadline, directory, manifest.continued
                )
                if resume:
                    await coordinator.resume(operation, time.time() + deadline)
                return sorted({key for reply in replies.values() for key in reply.restored})

        restored = run_operation(f"restore {manifest.checkpoint_id}…", as_json, work)
        payload = {
            "ok": True,
            "checkpoint_id": manifest.checkpoint_id,
            "operation_id": operation,
            "restored": restored,
            "resumed": resume,
        }
        emit(
            payload,
            as_json=as_json,
            render=lambda: console.print(
                f"[green]restored[/green] {counted(len(restored), 'episode')} from "
                f"{manifest.checkpoint_id}"
            ),
        )

    _simple(app)


def _simple(app: typer.Typer) -> None:
    @app.command("resume")
    def resume_command(
        cluster: ClusterOption,
        checkpoint_id: Annotated[str, typer.Option("--id", help="The open checkpoint's id.")],
        deadline: DeadlineOption = 30.0,
        as_json: JsonOption = False,
    ) -> None:
        """Reopen admission everywhere (aborts an unpublished checkpoint)."""
        servers, token = load_cluster(cluster), control_token()

        async def work() -> dict[str, bool]:
            async with coordinator_over(servers, token) as coordinator:
                replies = await coordinator.resume(checkpoint_id, time.time() + deadline)
                return {name: reply.idempotent for name, reply in replies.items()}

        replies = run_operation(f"resume {checkpoint_id}…", as_json, work)
        # An idempotent reply reopened nothing: the id was never open there, or already resumed.
        resumed = sorted(name for name, idempotent in replies.items() if not idempotent)
        untouched = sorted(name for name, idempotent in replies.items() if idempotent)

        def render() -> None:
            if resumed:
                console.print(f"[green]resumed[/green] {checkpoint_id} on {', '.join(resumed)}")
            if untouched and not resumed:
                console.print(
                    f"nothing to resume: {checkpoint_id} is not open on any participant "
                    "(never prepared, or already resumed)"
                )
            elif untouched:
                console.print(f"not open on {', '.join(untouched)} (nothing to do there)")

        emit(
            {
                "ok": True,
                "checkpoint_id": checkpoint_id,
                "resumed": resumed,
                "not_open": untouched,
            },
            as_json=as_json,
            render=render,
        )

    @app.command("retire")
    def retire_command(
        cluster: ClusterOption,
        keys: Annotated[list[str], typer.Argument(help="Capture keys of the attempts to retire.")],
        checkpoint_id: Annotated[str | None, typer.Option("--id", help="Operation id.")] = None,
        deadline: DeadlineOption = 30.0,
        as_json: JsonOption = False,
    ) -> None:
        """Refuse, stop and free these attempts (and every earlier one) everywhere."""
        servers, token = load_cluster(cluster), control_token()
        episodes = episodes_of(keys)  # all validated before anything is sent
        operation = checkpoint_id or f"retire-{int(time.time() * 1000)}"

        async def work() -> list[str]:
            async with coordinator_over(servers, token) as coordinator:
                return sorted(await coordinator.retire(operation, time.time() + deadline, episodes))

        names = run_operation("retire…", as_json, work)
        emit(
            {"ok": True, "retired": [e.capture_key for e in episodes], "participants": names},
            as_json=as_json,
            render=lambda: console.print(
                f"[green]retired[/green] {counted(len({e.capture_key for e in episodes}), 'attempt')}"
            ),
        )

    @app.command("forget")
    def forget_command(
        cluster: ClusterOption,
        rollout_ids: Annotated[list[str], typer.Argument(help="Rollouts whose marks to drop.")],
        checkpoint_id: Annotated[str | None, typer.Option("--id", help="Operation id.")] = None,
        deadline: DeadlineOption = 30.0,
        as_json: JsonOption = False,
    ) -> None:
        """Remove the retire marks of finished rollouts everywhere."""
        try:
            validate_rollout_ids(rollout_ids)  # before any server is asked
        except (WireError, TypeError) as exc:
            usage_error(str(exc))
        servers, token = load_cluster(cluster), control_token()
        operation = checkpoint_id or f"forget-{int(time.time() * 1000)}"

        async def work() -> list[str]:
            async with coordinator_over(servers, token) as coordinator:
                replies = await coordinator.forget(operation, time.time() + deadline, rollout_ids)
                return sorted(replies)

        names = run_operation("forget…", as_json, work)
        emit(
            {"ok": True, "forgotten": sorted(set(rollout_ids)), "participants": names},
            as_json=as_json,
            render=lambda: console.print(
                f"[green]forgot[/green] {counted(len(set(rollout_ids)), 'rollout')}"
            ),
        )
