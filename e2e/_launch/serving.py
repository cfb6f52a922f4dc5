"""Running one reference server process: bind, announce the port, serve.

A server binds its port itself (``--port 0`` picks a free one), listens, and only then prints
``listening on http://127.0.0.1:<port>`` on stdout, so a supervisor can read the port and connect
at once. After that line, everything the server prints goes to stderr (its log). With several
shard processes the main process binds and hands the work to them (``processes``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import structlog
import typer

from .._servers.context import CONTROL_TOKEN_ENV, HOST, ServeContext
from .._trace.setup import configure_tracing
from .collector_settings import apply_collector_thresholds
from .hosting import announce_listening
from .loop_watch import LoopWatch
from .processes import (
    WatchedServer,
    is_shard_process,
    metrics_registry,
    run_fanout,
    run_shard,
    server_config,
)
from .sockets import PortInUseError, bind_listening_socket


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


def run_server(app: Any, options: ServeContext | int, *, role: str = "server") -> None:
    """Bind, announce the port on stdout, and serve ``app`` (its lifespan included).

    Tracing is configured first, when ``--trace-dir`` or the ``OTEL_*`` variables ask for it;
    every process of the server traces (a shard inherits the trace directory). The collector's
    thresholds come from ``MIDFLIGHT_GC_THRESHOLDS`` when it is set (D428), in every process.
    """
    port = options if isinstance(options, int) else options.port
    configure_server_logging()
    try:
        thresholds = apply_collector_thresholds()
    except ValueError as exc:  # a usage error: one line, exit 2, before anything is bound
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        raise typer.Exit(2) from None
    if thresholds is not None:
        structlog.get_logger("midflight.serve").info(
            "collector_thresholds", thresholds=list(thresholds)
        )
    context = options if isinstance(options, ServeContext) else None
    configure_tracing(
        f"midflight-{role}",
        server=role if context is None else context.name,
        process="shard" if context is not None and is_shard_process() else "main",
        trace_dir=None if context is None else context.trace_dir,
    )
    if isinstance(options, ServeContext) and options.processes > 1:
        if is_shard_process():
            run_shard(app, options)
            return
        warn_if_control_is_off(options)
        try:
            run_fanout(app, options)
        except PortInUseError as exc:
            _refuse_port(exc)
        return
    warn_if_control_is_off(options)
    try:
        sock = bind_listening_socket(port)
    except PortInUseError as exc:
        _refuse_port(exc)
    with sock:
        announce_listening(f"http://{HOST}:{sock.getsockname()[1]}")
        watch = LoopWatch(registry=metrics_registry(app))
        WatchedServer(server_config(app, lifespan="auto"), watch).run(sockets=[sock])
