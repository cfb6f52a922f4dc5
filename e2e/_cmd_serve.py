"""``midflight serve <role>``: start one reference server on 127.0.0.1.

Each role lives in its own module (listed in ``SERVE_ROLE_MODULES``) that adds one command to the
``serve`` sub-app. A server binds its port itself (``--port 0`` picks a free one), listens, and only
then prints ``listening on http://127.0.0.1:<port>`` on stdout, so a supervisor can read the port
and connect at once. After that line, everything the server prints goes to stderr (its log).
The control token comes from ``MIDFLIGHT_CONTROL_TOKEN``; without it no control route is
installed. The capture token (ledger routes) comes from ``MIDFLIGHT_CAPTURE_TOKEN`` and defaults
to the control token.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn

import structlog
import typer
import uvicorn

from participants import ControlSettings
from protocols import DEFAULT_LEASE_GRACE_SECONDS, MidflightError

from ._cluster import Cluster, Role, default_cluster, read_cluster

HOST: Final = "127.0.0.1"
CONTROL_TOKEN_ENV: Final = "MIDFLIGHT_CONTROL_TOKEN"  # noqa: S105 - the variable name, not a token
CAPTURE_TOKEN_ENV: Final = "MIDFLIGHT_CAPTURE_TOKEN"  # noqa: S105 - the variable name, not a token
DEFAULT_ROOT: Final = Path("midflight-run")

SERVE_ROLE_MODULES: Final[tuple[str, ...]] = (
    "e2e._serve_worker",
    "e2e._serve_model",
    "e2e._serve_resources",
    "e2e._serve_agent",
    "e2e._serve_environment",
)
"""Modules that each add one role to ``serve`` (``register(serve_app)``)."""


class ServeOptions:
    """Option types every role shares."""

    Cluster = Annotated[
        Path | None,
        typer.Option("--cluster", help="Cluster file (TOML): the run root and the peers' URLs."),
    ]
    Root = Annotated[
        Path | None,
        typer.Option("--root", help="Run root; default: the cluster file's, else ./midflight-run."),
    ]
    CheckpointRoot = Annotated[
        Path | None,
        typer.Option(
            "--checkpoint-root",
            help="Commit and restore only checkpoint directories under DIR; default: the run root.",
        ),
    ]
    Workers = Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            max=64,
            help="Worker processes behind one port; still one participant (1: one process).",
        ),
    ]


@dataclass(frozen=True)
class ServeContext:
    """What a role needs to start: its name and port, the run root, its peers and tokens."""

    name: str
    port: int
    root: Path
    cluster: Cluster
    control_token: str | None
    capture_token: str | None
    workers: int = 1
    checkpoint_root: Path | None = None

    @property
    def checkpoints_under(self) -> Path:
        """The checkpoint root: ``checkpoint_root`` when given, else the run root (D240)."""
        return (self.checkpoint_root or self.root).resolve()

    def peer_url(self, role: Role) -> str:
        """The URL of the peer of ``role`` (from the cluster file, else its default port)."""
        return self.cluster.url_of(role)


def serve_options_from(
    *,
    name: str,
    port: int,
    cluster: Path | None,
    root: Path | None,
    workers: int = 1,
    checkpoint_root: Path | None = None,
) -> ServeContext:
    """Resolve the shared options of ``serve <role>``."""
    parsed = read_cluster(cluster) if cluster is not None else None
    run_root = (root or (parsed.root if parsed else DEFAULT_ROOT)).resolve()
    control = os.environ.get(CONTROL_TOKEN_ENV) or None
    capture = os.environ.get(CAPTURE_TOKEN_ENV) or control
    return ServeContext(
        name=name,
        port=port,
        root=run_root,
        cluster=parsed if parsed is not None else default_cluster(run_root),
        control_token=control,
        capture_token=capture,
        workers=workers,
        checkpoint_root=None if checkpoint_root is None else checkpoint_root.resolve(),
    )


FAULT_ENV: Final = "MIDFLIGHT_FAULT"
LEASE_GRACE_ENV: Final = "MIDFLIGHT_LEASE_GRACE_SECONDS"
"""Test flag: a shorter lease grace, so a test can watch a lease expire (D157)."""


def active_fault() -> str | None:
    """The drill fault switch this server runs with (``MIDFLIGHT_FAULT``), if any."""
    return os.environ.get(FAULT_ENV) or None


def control_settings(ctx: ServeContext) -> ControlSettings:
    """The control-plane settings of a reference server (faults included).

    Commit and restore are confined to ``ctx.checkpoints_under`` (D240).
    """
    grace = os.environ.get(LEASE_GRACE_ENV)
    return ControlSettings(
        fence_on_restore=active_fault() != "no-restore-fence",
        lease_grace_seconds=float(grace) if grace else DEFAULT_LEASE_GRACE_SECONDS,
        checkpoint_root=ctx.checkpoints_under,
    )


def configure_server_logging() -> None:
    """Structured JSON logs on stderr (the server's log file); stdout carries only the port line."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)


class PortInUseError(MidflightError, OSError):
    """The port a server was told to bind is taken (or not ours to bind)."""


def bind_listening_socket(port: int) -> socket.socket:
    """A socket bound to ``127.0.0.1:port`` and listening, so no other process can take the port.

    Raises:
        PortInUseError: The port is taken, or binding it is not permitted.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            reason = "already in use" if exc.errno == errno.EADDRINUSE else "not permitted"
            raise PortInUseError(exc.errno, f"port {port} on {HOST} is {reason}") from exc
        raise
    except BaseException:
        sock.close()
        raise
    return sock


def _refuse_port(exc: PortInUseError) -> NoReturn:
    # A usage error, not a crash: one line naming the port, exit 2, no traceback.
    sys.stderr.write(f"error: {exc.strerror} (choose another --port, or 0 for a free one)\n")
    sys.stderr.flush()
    raise typer.Exit(2)


def warn_if_control_is_off(options: ServeContext | int) -> None:
    """Say at start-up that a server without a control token takes no part in checkpoints."""
    if isinstance(options, ServeContext) and options.control_token is None:
        structlog.get_logger("midflight.serve").warning(
            "control_routes_disabled",
            server=options.name,
            detail=f"{CONTROL_TOKEN_ENV} is not set: no control route is installed, so this "
            "server takes no part in checkpoints, restores or generation cuts",
        )


def run_server(app: Any, options: ServeContext | int) -> None:
    """Bind, announce the port on stdout, and serve ``app`` (its lifespan included)."""
    port = options if isinstance(options, int) else options.port
    configure_server_logging()
    if isinstance(options, ServeContext) and options.workers > 1:
        from ._workers_serve import is_worker_process, run_coordinator, run_worker

        if is_worker_process():
            run_worker(app, options)
            return
        warn_if_control_is_off(options)
        try:
            run_coordinator(app, options)
        except PortInUseError as exc:
            _refuse_port(exc)
        return
    warn_if_control_is_off(options)
    try:
        sock = bind_listening_socket(port)
    except PortInUseError as exc:
        _refuse_port(exc)
    with sock:
        bound = sock.getsockname()[1]
        sys.stdout.write(f"listening on http://{HOST}:{bound}\n")
        sys.stdout.flush()
        # Nobody reads stdout after the port line: anything printed later must not fill the pipe.
        sys.stdout = sys.stderr
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="auto")
        uvicorn.Server(config).run(sockets=[sock])


def register(app: typer.Typer) -> None:
    """Add the ``serve`` sub-app with every role."""
    serve_app = typer.Typer(
        name="serve",
        help="Start one reference server on 127.0.0.1.",
        no_args_is_help=True,
        add_completion=False,
    )
    for module_name in SERVE_ROLE_MODULES:
        importlib.import_module(module_name).register(serve_app)
    app.add_typer(serve_app)
