"""``midflight serve <role>``: start one reference server on 127.0.0.1.

Every role adds one command to the ``serve`` sub-app here; the server itself is built by its
module in ``e2e._servers`` (or ``e2e._worker``) and run by ``e2e._launch.serving``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from participants import LedgerLayoutError

from .._launch.serving import run_server
from .._servers.agent import create_agent_app
from .._servers.cluster import DEFAULT_NAMES, DEFAULT_PORTS
from .._servers.context import active_fault
from .._servers.environment import DEFAULT_EPISODE_SECONDS, PeerTimeouts, create_environment_app
from .._servers.model import create_model_app
from .._servers.resources import create_resources_app
from .._worker.app import DEFAULT_WORKER_PORT, WorkerSettings, create_worker_app
from .._worker.engines import DEFAULT_ENGINE, EngineError, engine_names
from .output import usage_error
from .serve_options import (
    LedgerLayoutChoice,
    ModeChoice,
    ServeOptions,
    VerifyChoice,
    checkpoint_root_option,
    serve_options,
)

DETERMINISTIC_TOKEN_DELAY_MS = 2.0


def register(app: typer.Typer) -> None:
    """Add the ``serve`` sub-app with every role."""
    serve_app = typer.Typer(
        name="serve",
        help="Start one reference server on 127.0.0.1.",
        no_args_is_help=True,
        add_completion=False,
    )
    for register_role in (
        _register_worker,
        _register_model,
        _register_resources,
        _register_agent,
        _register_environment,
    ):
        register_role(serve_app)
    app.add_typer(serve_app)


_DEFAULT_TIMEOUTS = PeerTimeouts()


def _register_worker(serve_app: typer.Typer) -> None:
    """Add ``worker`` to the ``serve`` sub-app."""

    @serve_app.command("worker")
    def serve_worker(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_WORKER_PORT
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = "worker",
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        trace_dir: ServeOptions.TraceDir = None,
        token_delay_ms: Annotated[
            float | None,
            typer.Option(
                min=0.0,
                help="Delay before each generated token (a model engine: a pause before each "
                "decode step) \\[default: 2 on the deterministic engine, else 0].",
            ),
        ] = None,
        seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="Generation seed.")] = 0,
        cut_timeout_ms: Annotated[
            float,
            typer.Option(min=1.0, help="Deadline of a generation-cut round (every call it cuts)."),
        ] = 5000.0,
        engine: Annotated[
            str,
            typer.Option(
                metavar="NAME",
                help=f"The inference engine: {', '.join(engine_names())}.",
            ),
        ] = DEFAULT_ENGINE,
        model: Annotated[
            Path | None,
            typer.Option(
                metavar="DIR",
                help="The model directory of a model engine (midflight model tiny DIR builds one).",
            ),
        ] = None,
        dtype: Annotated[
            str,
            typer.Option(
                help="A model engine's floating-point type: float64 (argmax-stable), float32, "
                "bfloat16."
            ),
        ] = "float64",
        max_batch: Annotated[
            int, typer.Option(min=1, max=4096, help="Most calls a model engine decodes together.")
        ] = 64,
    ) -> None:
        """The inference worker (default port 8701), on the deterministic engine by default."""
        options = serve_options(
            name=name, port=port, cluster=cluster, root=root, trace_dir=trace_dir
        )
        if token_delay_ms is None:
            token_delay_ms = DETERMINISTIC_TOKEN_DELAY_MS if engine == DEFAULT_ENGINE else 0.0
        settings = WorkerSettings(
            root=options.root,
            seed=seed,
            token_delay_ms=token_delay_ms,
            cut_timeout_ms=cut_timeout_ms,
            control_token=options.control_token,
            name=name,
            engine=engine,
            model=model,
            dtype=dtype,
            max_batch=max_batch,
            fault=active_fault(),
        )
        try:
            app = create_worker_app(settings)
        except EngineError as exc:  # an unknown engine, or one whose packages are missing
            usage_error(str(exc))
        run_server(app, options, role="worker")


def _register_model(serve_app: typer.Typer) -> None:
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
        trace_dir: ServeOptions.TraceDir = None,
        processes: ServeOptions.Processes = 1,
        checkpoint_root: ServeOptions.CheckpointRoot = None,
        worker_url: Annotated[
            str | None,
            typer.Option(help="The inference worker's URL; default: the cluster's worker."),
        ] = None,
        admission_wait_s: Annotated[
            float, typer.Option(min=0.1, help="Longest a call waits for a checkpoint to resume.")
        ] = 900.0,
        ledger_layout: Annotated[
            LedgerLayoutChoice,
            typer.Option(
                help="The capture ledger on disk: sqlite (one database file for every rollout) "
                "or file (files per rollout)."
            ),
        ] = LedgerLayoutChoice.sqlite,
    ) -> None:
        """The policy server: chat completions captured into <root>/ledger (default port 8702)."""
        options = serve_options(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            processes=processes,
            checkpoint_root=checkpoint_root_option(checkpoint_root),
            trace_dir=trace_dir,
        )
        try:
            app = create_model_app(
                options,
                worker_url=worker_url,
                admission_wait_seconds=admission_wait_s,
                ledger_layout=ledger_layout.value,
            )
        except LedgerLayoutError as exc:  # a run root written with the other layout
            usage_error(str(exc))
        run_server(app, options, role="model")


def _register_resources(serve_app: typer.Typer) -> None:
    """Add ``resources`` to the ``serve`` sub-app."""

    @serve_app.command("resources")
    def serve_resources(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["resources"]
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = DEFAULT_NAMES["resources"],
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        trace_dir: ServeOptions.TraceDir = None,
        processes: ServeOptions.Processes = 1,
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
        options = serve_options(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            processes=processes,
            checkpoint_root=checkpoint_root_option(checkpoint_root),
            trace_dir=trace_dir,
        )
        app = create_resources_app(
            options,
            mode=mode.value,
            verify=verify.value,
            verify_delay_ms=verify_delay_ms,
            verify_hold_dir=verify_hold_dir,
        )
        run_server(app, options, role="resources")


def _register_agent(serve_app: typer.Typer) -> None:
    """Add ``agent`` to the ``serve`` sub-app."""

    @serve_app.command("agent")
    def serve_agent(
        port: Annotated[int, typer.Option(min=0, max=65535, help="0 picks a free port.")] = (
            DEFAULT_PORTS["agent"]
        ),
        name: Annotated[str, typer.Option(help="The server's name.")] = DEFAULT_NAMES["agent"],
        cluster: ServeOptions.Cluster = None,
        root: ServeOptions.Root = None,
        trace_dir: ServeOptions.TraceDir = None,
        processes: ServeOptions.Processes = 1,
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
        options = serve_options(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            processes=processes,
            checkpoint_root=checkpoint_root_option(checkpoint_root),
            trace_dir=trace_dir,
        )
        run_server(create_agent_app(options, restart_only=restart_only), options, role="agent")


def _register_environment(serve_app: typer.Typer) -> None:
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
        trace_dir: ServeOptions.TraceDir = None,
        processes: ServeOptions.Processes = 1,
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
        options = serve_options(
            name=name,
            port=port,
            cluster=cluster,
            root=root,
            processes=processes,
            checkpoint_root=checkpoint_root_option(checkpoint_root),
            trace_dir=trace_dir,
        )
        timeouts = PeerTimeouts(
            call_s=peer_timeout_s, activation_s=activation_timeout_s, verify_s=verify_timeout_s
        )
        app = create_environment_app(options, episode_seconds=episode_seconds, timeouts=timeouts)
        run_server(app, options, role="environment")
