"""``midflight serve resources``: the counter resources server (default port 8703)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ._cluster import DEFAULT_NAMES, DEFAULT_PORTS
from ._cmd_serve import ServeOptions, run_server, serve_options_from
from ._server_resources import create_resources_app


class ModeChoice(StrEnum):
    """``--mode``: how sessions survive a checkpoint."""

    exported = "exported"
    stateless = "stateless"
    restart_only = "restart_only"


class VerifyChoice(StrEnum):
    """``--verify``: whether a checkpoint waits for verify or lets it be re-run."""

    wait = "wait"
    replay = "replay"


def register(serve_app: typer.Typer) -> None:
    """Add ``resources`` to the ``serve`` sub-app."""

    @serve_app.command("resources")
    def serve_resources(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["resources"]
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = DEFAULT_NAMES["resources"],
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        workers: ServeOptions.Workers = 1,
        checkpoint_root: ServeOptions.CheckpointRoot = None,
        mode: Annotated[
            ModeChoice, typer.Option(help="exported (the reference deployment), stateless, …")
        ] = ModeChoice.exported,
        verify: Annotated[
            VerifyChoice, typer.Option(help="Announced on every seed: wait or replay.")
        ] = VerifyChoice.wait,
        verify_delay_ms: Annotated[
            float, typer.Option(min=0.0, help="How long each verify takes (slow variant).")
        ] = 0.0,
        verify_hold_dir: Annotated[
            Path | None,
            typer.Option(
                help="Test knob: a verify waits until a file named by its capture key is in DIR."
            ),
        ] = None,
    ) -> None:
        """The counter resources server (default port 8703)."""
        options = serve_options_from(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            workers=workers,
            checkpoint_root=checkpoint_root,
        )
        app = create_resources_app(
            options,
            mode=mode.value,
            verify=verify.value,
            verify_delay_ms=verify_delay_ms,
            verify_hold_dir=verify_hold_dir,
        )
        run_server(app, options)
