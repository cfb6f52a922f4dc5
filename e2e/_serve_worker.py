"""``midflight serve worker``: the deterministic inference worker."""

from __future__ import annotations

from typing import Annotated

import typer

from ._cmd_serve import ServeOptions, run_server, serve_options_from
from ._worker import DEFAULT_WORKER_PORT, WorkerSettings, create_worker_app


def register(serve_app: typer.Typer) -> None:
    """Add ``worker`` to the ``serve`` sub-app."""

    @serve_app.command("worker")
    def serve_worker(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_WORKER_PORT
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = "worker",
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        token_delay_ms: Annotated[
            float, typer.Option(min=0.0, help="Delay before each generated token.")
        ] = 2.0,
        seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="Generation seed.")] = 0,
        cut_timeout_ms: Annotated[
            float, typer.Option(min=1.0, help="Deadline of one call's generation cut.")
        ] = 5000.0,
    ) -> None:
        """The deterministic inference worker (default port 8701)."""
        options = serve_options_from(name=name, port=port, cluster=cluster, root=root)
        settings = WorkerSettings(
            root=options.root,
            seed=seed,
            token_delay_ms=token_delay_ms,
            cut_timeout_ms=cut_timeout_ms,
            control_token=options.control_token,
            name=name,
        )
        run_server(create_worker_app(settings), options)
