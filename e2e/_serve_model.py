"""``midflight serve model``: the policy server (participant kind ``model``)."""

from __future__ import annotations

from typing import Annotated

import typer

from ._cluster import DEFAULT_NAMES, DEFAULT_PORTS
from ._cmd_serve import ServeOptions, run_server, serve_options_from
from ._server_model import create_model_app


def register(serve_app: typer.Typer) -> None:
    """Add ``model`` to the ``serve`` sub-app."""

    @serve_app.command("model")
    def serve_model(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["model"]
        ),
        name: Annotated[str, typer.Option(help="The server's name (its instance).")] = (
            DEFAULT_NAMES["model"]
        ),
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        workers: ServeOptions.Workers = 1,
        checkpoint_root: ServeOptions.CheckpointRoot = None,
        worker_url: Annotated[
            str | None,
            typer.Option(help="The inference worker's URL; default: the cluster's worker."),
        ] = None,
        admission_wait_s: Annotated[
            float, typer.Option(min=0.1, help="Longest a call waits for a checkpoint to resume.")
        ] = 900.0,
    ) -> None:
        """The policy server: chat completions captured into <root>/ledger (default port 8702)."""
        options = serve_options_from(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            workers=workers,
            checkpoint_root=checkpoint_root,
        )
        app = create_model_app(
            options, worker_url=worker_url, admission_wait_seconds=admission_wait_s
        )
        run_server(app, options)
