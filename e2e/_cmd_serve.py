"""``midflight serve <role>``: start one reference server on 127.0.0.1.

Each role is a command of the ``serve`` sub-app; this issue adds ``worker``. A server binds its port
itself (``--port 0`` picks a free one) and prints ``listening on http://127.0.0.1:<port>`` on stdout,
flushed, before it serves, so a supervisor can read the port it got. The control token comes from
``MIDFLIGHT_CONTROL_TOKEN``; without it no control route is installed.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Final

import typer
import uvicorn

from ._worker import DEFAULT_WORKER_PORT, WorkerSettings, create_worker_app

HOST: Final = "127.0.0.1"
CONTROL_TOKEN_ENV: Final = "MIDFLIGHT_CONTROL_TOKEN"  # noqa: S105 - the variable name, not a token
DEFAULT_ROOT: Final = Path("midflight-run")

serve_app = typer.Typer(
    name="serve",
    help="Start one reference server on 127.0.0.1.",
    no_args_is_help=True,
    add_completion=False,
)

PortOption = Annotated[
    int, typer.Option(min=0, max=65535, help="Port on 127.0.0.1; 0 picks a free one.")
]
RootOption = Annotated[
    Path, typer.Option(help="The run root: staging/, evidence/ and the rest live under it.")
]


def bind_listening_socket(port: int) -> socket.socket:
    """A socket bound to ``127.0.0.1:port`` and listening, so no other process can take the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def run_server(app: object, port: int) -> None:
    """Bind, announce the port on stdout, and serve ``app`` until interrupted."""
    sock = bind_listening_socket(port)
    with sock:
        bound = sock.getsockname()[1]
        sys.stdout.write(f"listening on http://{HOST}:{bound}\n")
        sys.stdout.flush()
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")  # type: ignore[arg-type]
        uvicorn.Server(config).run(sockets=[sock])


@serve_app.command("worker")
def serve_worker(
    port: PortOption = DEFAULT_WORKER_PORT,
    root: RootOption = DEFAULT_ROOT,
    token_delay_ms: Annotated[
        float, typer.Option(min=0.0, help="Delay before each generated token.")
    ] = 2.0,
    seed: Annotated[int, typer.Option(min=0, max=2**64 - 1, help="Generation seed.")] = 0,
    cut_timeout_ms: Annotated[
        float, typer.Option(min=1.0, help="Deadline of one call's generation cut.")
    ] = 5000.0,
    name: Annotated[str, typer.Option(help="The server's name.")] = "worker",
) -> None:
    """The deterministic inference worker (default port 8701)."""
    settings = WorkerSettings(
        root=root.resolve(),
        seed=seed,
        token_delay_ms=token_delay_ms,
        cut_timeout_ms=cut_timeout_ms,
        control_token=os.environ.get(CONTROL_TOKEN_ENV) or None,
        name=name,
    )
    run_server(create_worker_app(settings), port)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` sub-app."""
    app.add_typer(serve_app)
