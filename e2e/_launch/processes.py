"""``--processes N``: one reference server as a main process and N shard processes.

The main process binds the public port and one private port per slot on 127.0.0.1, prints the
``listening on`` line, and runs the fan-out (the control plane over a
:class:`participants.ProcessFanout`). It starts each shard as ``python -m e2e <same command>``
with the sockets inherited, in its own process group (a SIGKILL of the group leaves no shard
holding the port), and starts a shard again, in the same slot, when one exits.

A shard serves the role's app on the shared socket and its private one, behind
:class:`ShardRouting`: control calls are relayed to the fan-out, a data-plane request of a
rollout another slot owns is proxied to that shard's private port, ``/close_session`` is
broadcast, and ``/metrics`` is aggregated across shards.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import structlog
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from participants import (
    FANOUT_SOCKET_ENV,
    SOCKET_OWNER_FILE,
    BodyLimit,
    ControlPlane,
    FanoutShard,
    ModelProcessFanout,
    Placement,
    ProcessFanout,
    listen_private,
    private_socket_path,
)

from .._servers.context import HOST, ServeContext, control_settings
from .._servers.peer_pool import SERVER_KEEP_ALIVE_S
from .hosting import announce_listening, on_main_thread, serve_argv
from .keep_alive import PatientHttpToolsProtocol
from .lifeline import Lifeline
from .loop_watch import LoopWatch, run_watched
from .routing import ShardRouting
from .sockets import bind_listening_socket

SLOT_ENV: Final = "MIDFLIGHT_FANOUT_SLOT"
SHARED_FD_ENV: Final = "MIDFLIGHT_FANOUT_SHARED_FD"
PRIVATE_FD_ENV: Final = "MIDFLIGHT_FANOUT_PRIVATE_FD"
PEERS_ENV: Final = "MIDFLIGHT_FANOUT_PEERS"
"""Comma-separated private ports, one per slot in slot order."""
RESTART_DELAY_SECONDS: Final = 0.5
"""A shard that exits is started again after this pause (a crash loop stays slow)."""

_log = structlog.get_logger("midflight.fanout")


def is_shard_process() -> bool:
    """Whether this process was started by a main process as one of its shards."""
    return SLOT_ENV in os.environ


def run_shard(app: FastAPI, ctx: ServeContext) -> None:
    """Serve ``app`` as the shard in slot ``$MIDFLIGHT_FANOUT_SLOT`` (blocks)."""
    slot = int(os.environ[SLOT_ENV])
    shared = socket.socket(fileno=int(os.environ[SHARED_FD_ENV]))
    private = socket.socket(fileno=int(os.environ[PRIVATE_FD_ENV]))
    peers = [f"http://{HOST}:{port}" for port in os.environ[PEERS_ENV].split(",")]
    plane: ControlPlane = app.state.plane
    shard = FanoutShard(plane, slot=slot, socket_path=os.environ[FANOUT_SOCKET_ENV])
    original = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(inner: Any) -> AsyncIterator[None]:
        async with original(inner), shard.running():
            yield

    app.router.lifespan_context = lifespan
    routed = ShardRouting(app, shard=shard, slot=slot, peers=peers, token=ctx.control_token)
    # Routing reads whole bodies to relay or proxy them: the limit must come before it (D241).
    watch = LoopWatch(registry=metrics_registry(app), process=f"shard-{slot}")
    config = server_config(BodyLimit(routed), lifespan="on")
    WatchedServer(config, watch).run(sockets=[shared, private])


def metrics_registry(app: Any) -> CollectorRegistry | None:
    """The registry a server's ``/metrics`` shows: its control plane's, or the worker's own."""
    state = getattr(app, "state", None)
    plane = getattr(state, "plane", None)
    if plane is not None:
        registry: CollectorRegistry = plane.telemetry.registry
        return registry
    return getattr(state, "metrics_registry", None)


class WatchedServer(uvicorn.Server):
    """uvicorn's server with a :class:`LoopWatch` on its event loop while it serves (D406)."""

    def __init__(self, config: uvicorn.Config, watch: LoopWatch) -> None:
        super().__init__(config)
        self.watch = watch

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        async with self.watch.watching():
            await super().serve(sockets=sockets)


def server_config(app: Any, *, lifespan: Literal["auto", "on", "off"]) -> uvicorn.Config:
    """uvicorn's configuration of every reference server and shard: quiet, and an idle
    connection kept for ``SERVER_KEEP_ALIVE_S``, far past any client's pool expiry (D374), and
    never closed with a request waiting in it (D451)."""
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        http=PatientHttpToolsProtocol,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )


def run_fanout(app: FastAPI, ctx: ServeContext) -> None:
    """Bind, announce the port, start the shards and run the fan-out until told to stop."""
    shared = bind_listening_socket(ctx.port)
    privates = [bind_listening_socket(0) for _ in range(ctx.processes)]
    participant = app.state.plane.participant
    announce_listening(f"http://{HOST}:{shared.getsockname()[1]}")
    serve = partial(_serve_fanout, participant.kind, participant.instance, ctx, shared, privates)
    # The shards' watches feed the summed /metrics; the main process's stalls are logged only
    # (its own families would hide the shards', D406).
    anyio.run(run_watched, serve, "main")


async def _serve_fanout(
    kind: Any,
    instance: str,
    ctx: ServeContext,
    shared: socket.socket,
    privates: list[socket.socket],
) -> None:
    # An environment episode lives inside one /run, which may land on any shard (D196).
    placement: Placement = "claim" if kind == "environment" else "slot"
    fanout = (
        # The model's undelivered calls, restored cuts and ledger import need their own rules.
        ModelProcessFanout(instance, expected=ctx.processes)
        if kind == "model"
        else ProcessFanout(kind, instance, expected=ctx.processes, placement=placement)
    )
    plane = ControlPlane(fanout, settings=control_settings(ctx))
    path = private_socket_path(instance)
    listener = await listen_private(path)
    peers = ",".join(str(s.getsockname()[1]) for s in privates)
    stop = anyio.Event()
    processes: dict[int, subprocess.Popen[bytes]] = {}
    lifelines: dict[int, Lifeline] = {}

    def start(slot: int) -> None:
        if slot in lifelines:
            lifelines.pop(slot).cut()
        lifeline = lifelines[slot] = Lifeline()  # a shard dies with its main process (D242)
        env = {
            **os.environ,
            **lifeline.env,
            FANOUT_SOCKET_ENV: str(path),
            SLOT_ENV: str(slot),
            SHARED_FD_ENV: str(shared.fileno()),
            PRIVATE_FD_ENV: str(privates[slot].fileno()),
            PEERS_ENV: peers,
        }
        processes[slot] = subprocess.Popen(
            [sys.executable, "-m", "e2e", *serve_argv()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            pass_fds=(shared.fileno(), privates[slot].fileno(), *lifeline.pass_fds),
        )
        lifeline.started()
        _log.info("shard.started", participant=instance, slot=slot, pid=processes[slot].pid)

    async def watch_shards() -> None:
        while not stop.is_set():
            for slot in range(ctx.processes):
                process = processes.get(slot)
                if process is None or process.poll() is not None:
                    if process is not None:
                        await anyio.sleep(RESTART_DELAY_SECONDS)
                    start(slot)
            with anyio.move_on_after(0.2):
                await stop.wait()

    async with plane.running(), anyio.create_task_group() as group:
        group.start_soon(fanout.serve, listener, plane)
        group.start_soon(watch_shards)
        await _until_told_to_stop()
        stop.set()
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            await anyio.to_thread.run_sync(_reap, process)
        group.cancel_scope.cancel()
    await listener.aclose()
    await anyio.to_thread.run_sync(_remove_socket, path)


async def _until_told_to_stop() -> None:
    """SIGTERM or SIGINT in a process of its own; a hosted server runs until its host dies."""
    if not on_main_thread():
        await anyio.sleep_forever()
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _signal in signals:
            return


def _remove_socket(path: Path) -> None:
    path.unlink(missing_ok=True)
    (path.parent / SOCKET_OWNER_FILE).unlink(missing_ok=True)
    path.parent.rmdir()


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


__all__ = [
    "WatchedServer",
    "is_shard_process",
    "metrics_registry",
    "run_fanout",
    "run_shard",
]
