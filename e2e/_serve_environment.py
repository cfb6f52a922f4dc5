"""``midflight serve environment``: the environment server (``/run``)."""

from __future__ import annotations

from typing import Annotated

import typer

from ._cluster import DEFAULT_NAMES, DEFAULT_PORTS
from ._cmd_serve import ServeOptions, run_server, serve_options_from
from ._server_environment import DEFAULT_EPISODE_SECONDS, PeerTimeouts, create_environment_app

_DEFAULT_TIMEOUTS = PeerTimeouts()


def register(serve_app: typer.Typer) -> None:
    """Add ``environment`` to the ``serve`` sub-app."""

    @serve_app.command("environment")
    def serve_environment(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["environment"]
        ),
        name: Annotated[str, typer.Option(help="The server's name (its instance).")] = (
            DEFAULT_NAMES["environment"]
        ),
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        workers: ServeOptions.Workers = 1,
        checkpoint_root: ServeOptions.CheckpointRoot = None,
        episode_seconds: Annotated[
            float,
            typer.Option(
                min=0.001,
                help="Each attempt's budget in seconds; time held by checkpoints is not counted.",
            ),
        ] = DEFAULT_EPISODE_SECONDS,
        peer_timeout_s: Annotated[
            float, typer.Option(min=0.001, help="Longest wait for a seed or close, in seconds.")
        ] = _DEFAULT_TIMEOUTS.call_s,
        activation_timeout_s: Annotated[
            float,
            typer.Option(min=0.001, help="Longest wait for one agent activation, in seconds."),
        ] = _DEFAULT_TIMEOUTS.activation_s,
        verify_timeout_s: Annotated[
            float,
            typer.Option(min=0.001, help="Longest wait for a verify (a reward model), in seconds."),
        ] = _DEFAULT_TIMEOUTS.verify_s,
    ) -> None:
        """The environment server (default port 8705): episodes via the agent and resources."""
        options = serve_options_from(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            workers=workers,
            checkpoint_root=checkpoint_root,
        )
        timeouts = PeerTimeouts(
            call_s=peer_timeout_s, activation_s=activation_timeout_s, verify_s=verify_timeout_s
        )
        app = create_environment_app(options, episode_seconds=episode_seconds, timeouts=timeouts)
        run_server(app, options)
