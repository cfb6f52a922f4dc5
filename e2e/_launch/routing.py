"""What a shard process does before its app sees a request: relay, route, broadcast, aggregate.

- ``/ng-control/v1/checkpoint/<operation>``: the bearer token is checked here, then the call is
  relayed to the fan-out in the main process, which owns the control plane.
- ``/ng-rollout/<capture_key>/…`` of a rollout another slot owns: proxied to that shard's private
  port, so every request of a rollout meets the state its earlier requests left.
- ``/close_session`` (named by a cookie only): sent to every other shard too; closing is
  idempotent and never refused.
- ``/metrics``: the main process's control-plane families, plus every shard's other families
  summed sample by sample.
- ``/healthz``: 503 until a shard runs in every slot, so "healthy" means a restore can be
  served (D244); then the app's own answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, Response

from coordinator import HttpClient
from participants import FanoutShard, authorized, continued, error_response, slot_of
from protocols import (
    CONTROL_PREFIX,
    TRACEPARENT_HEADER,
    CheckpointCoordinatorUnavailableError,
    EpisodeId,
    UnauthorizedError,
    WireError,
)

from .._servers.peer_pool import HELD_CALL_TIMEOUT, peer_transport
from .._trace.propagation import TRACE_HOOKS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROUTED_HEADER: Final = "x-midflight-routed"
"""Set on a request one shard passes to another: the receiver serves it, never passes it on."""
BROADCAST_PATHS: Final = frozenset({"/close_session"})
_HOP_HEADERS: Final = frozenset({"host", "content-length", "transfer-encoding", "connection"})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


class ShardRouting:
    """The ASGI wrapper around a shard process's app.

    Args:
        app: The role's app (its own control routes are never reached).
        shard: The shard's connection to the fan-out.
        slot: This shard's slot.
        peers: Every slot's private base URL, in slot order.
        token: The control token; ``None`` leaves control routes uninstalled (404).
    """

    def __init__(
        self, app: ASGIApp, *, shard: FanoutShard, slot: int, peers: list[str], token: str | None
    ) -> None:
        self.app = app
        self.shard = shard
        self.slot = slot
        self.peers = peers
        self.token = token
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = proxy_client()
        return self._client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        routed = ROUTED_HEADER in headers
        if path.startswith(CONTROL_PREFIX + "/") and self.token is not None:
            await self._relay_control(scope, receive, send, headers)
        elif path == "/metrics" and not routed:
            await self._metrics(scope, receive, send)
        elif path == "/healthz" and not routed:
            await self._health(scope, receive, send)
        elif not routed and (owner := self._owner(path)) is not None and owner != self.slot:
            await self._proxy(scope, receive, send, self.peers[owner])
        elif not routed and path in BROADCAST_PATHS:
            body = await _read_body(receive)
            async with anyio.create_task_group() as group:
                for slot, peer in enumerate(self.peers):
                    if slot != self.slot:
                        group.start_soon(self._forward_quietly, scope, body, peer)
            await self.app(scope, _replay(body), send)
        else:
            await self.app(scope, receive, send)

    def _owner(self, path: str) -> int | None:
        parts = path.split("/")
        if len(parts) < 3 or parts[1] != "ng-rollout":
            return None
        try:
            rollout = EpisodeId.from_capture_key(parts[2]).rollout_id
        except (WireError, ValueError):
            return None  # the app refuses it with its own typed error
        slot: int = slot_of(rollout, len(self.peers))
        return slot

    async def _relay_control(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        if not authorized(headers.get("authorization"), self.token or ""):
            response: Response = error_response(UnauthorizedError("missing or wrong bearer token"))
        else:
            operation = scope["path"][len(CONTROL_PREFIX) + 1 :]
            body = await _read_body(receive)
            try:
                # Relayed before the app (and its telemetry) sees it: the caller's trace goes on.
                with continued(headers.get(TRACEPARENT_HEADER)):
                    reply = await self.shard.relay_control(operation, body)
                response = JSONResponse(reply)
            except WireError as exc:
                response = error_response(exc)
        await response(scope, receive, send)

    def _request(self, scope: Scope, body: bytes, peer: str) -> httpx.Request:
        headers = [
            (k.decode(), v.decode())
            for k, v in scope.get("headers", [])
            if k.decode().lower() not in _HOP_HEADERS
        ]
        headers.append((ROUTED_HEADER, "1"))
        url = peer + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        return self.client.build_request(scope["method"], url, headers=headers, content=body)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, peer: str) -> None:
        body = await _read_body(receive)
        try:
            reply = await self.client.send(self._request(scope, body, peer), stream=True)
        except httpx.TransportError as exc:  # a typed, retryable refusal, never a bare 500
            refusal = error_response(
                CheckpointCoordinatorUnavailableError(
                    f"shard {peer} did not answer the routed request: {exc!r}"[:500]
                )
            )
            await refusal(scope, receive, send)
            return
        try:
            headers = [
                (k.encode(), v.encode())
                for k, v in reply.headers.multi_items()
                if k.lower() not in _HOP_HEADERS
            ]
            await send(
                {"type": "http.response.start", "status": reply.status_code, "headers": headers}
            )
            async for chunk in reply.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await reply.aclose()

    async def _forward_quietly(self, scope: Scope, body: bytes, peer: str) -> None:
        try:
            with anyio.fail_after(30):
                await self.client.send(self._request(scope, body, peer))
        except (httpx.HTTPError, TimeoutError):
            pass  # closing is idempotent: a shard that misses it holds nothing of the session

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        health: dict[str, Any]
        try:
            health = (await self.shard.health()).model_dump()
        except (WireError, RuntimeError) as exc:  # a broken link, or not connected yet
            health = {"ready": False, "detail": f"the fan-out did not answer: {exc!r}"}
        if health["ready"]:
            await self.app(scope, receive, send)
            return
        response = JSONResponse({"status": "starting", **health}, status_code=503)
        await response(scope, receive, send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        texts = await self.shard.gather_metrics()
        response = Response(aggregate_metrics(texts.main, texts.shards), media_type="text/plain")
        await response(scope, receive, send)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def aggregate_metrics(main: str, shards: list[str]) -> str:
    """One exposition: the main process's families as they are, the shards' others summed."""
    own = {family.name for family in text_string_to_metric_families(main)}
    summed: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    kinds: dict[str, tuple[str, str]] = {}
    for text in shards:
        for family in text_string_to_metric_families(text):
            if family.name in own:
                continue
            kinds[family.name] = (family.type, family.documentation)
            samples = summed.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # a creation time does not add up across processes
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = samples.get(key, 0.0) + sample.value
    lines = [main.rstrip("\n")]
    for name in sorted(summed):
        kind, documentation = kinds[name]
        lines.append(f"# HELP {name} {documentation}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample_name, labels), value in sorted(summed[name].items()):
            rendered = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(
                f"{sample_name}{{{rendered}}} {value!r}" if labels else f"{sample_name} {value!r}"
            )
    return "\n".join(lines) + "\n"


def proxy_client() -> httpx.AsyncClient:
    """The client a shard proxies other slots' requests with (held calls wait long)."""
    return HttpClient(
        timeout=HELD_CALL_TIMEOUT,
        follow_redirects=False,
        transport=peer_transport(),
        event_hooks=TRACE_HOOKS,
    )
