"""``midflight serve agent``: the reference agent server (calls the policy and the resources)."""

from __future__ import annotations

from typing import Annotated

import typer

from ._cluster import DEFAULT_NAMES, DEFAULT_PORTS
from ._cmd_serve import ServeOptions, run_server, serve_options_from
from ._server_agent import create_agent_app


def register(serve_app: typer.Typer) -> None:
    """Add ``agent`` to the ``serve`` sub-app."""

    @serve_app.command("agent")
    def serve_agent(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["agent"]
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = DEFAULT_NAMES["agent"],
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        workers: ServeOptions.Workers = 1,
        checkpoint_root: ServeOptions.CheckpointRoot = None,
        restart_only: Annotated[
            bool,
            typer.Option(
                "--restart-only/--no-restart-only",
                help="Sessions are restarted after a crash, never captured (opaque harnesses).",
            ),
        ] = False,
    ) -> None:
        """The agent server (default port 8704): sessions driven by the environment."""
        options = serve_options_from(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            workers=workers,
            checkpoint_root=checkpoint_root,
        )
        run_server(create_agent_app(options, restart_only=restart_only), options)
