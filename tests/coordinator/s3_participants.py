"""Participants that keep their shares on S3, for the coordinator's tests of an ``s3://`` root.

The coordinator's side of an object store root is tested here, independently of the participant
runtime's own S3 writer: an ASGI middleware in front of a participant app plays an S3
participant. A commit or restore whose ``checkpoint_dir`` is ``s3://…/checkpoints/<id>`` runs on
a local mirror directory; before a commit's reply leaves, the share the runtime wrote there is
uploaded (records first, the manifest last, each created once, as an S3 participant publishes);
a restore first downloads every object of the checkpoint. Everything else passes through.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import anyio

from protocols import MANIFEST_FILE, is_object_store_url, open_store, split_s3_url

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
ROUTES = ("/checkpoint/commit", "/checkpoint/restore")


def upload_share(directory: Path, location: str) -> None:
    """Create every file below ``directory`` as an object under ``location``, manifests last."""
    store = open_store(location)
    files = [p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")]
    for path in sorted(files, key=lambda p: (p.name == MANIFEST_FILE, str(p))):
        store.create(path.relative_to(directory).as_posix(), path.read_bytes())


def download_checkpoint(location: str, directory: Path) -> None:
    """Write every object under ``location`` into ``directory``."""
    store = open_store(location)
    for stored in store.list_objects(""):
        target = directory / stored.key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.read(stored.key))


class S3Shares:
    """An ASGI middleware: the participant behind it commits to and restores from ``s3://``.

    Args:
        app: The participant app.
        mirror: A local directory of this participant alone.
    """

    def __init__(self, app: ASGIApp, mirror: Path) -> None:
        self.app = app
        self.mirror = mirror
        self._restores = itertools.count()
        self.locations: list[str] = []
        """Every ``s3://`` checkpoint_dir a commit or restore named, in order."""

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or not path.endswith(ROUTES):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        location = payload.get("checkpoint_dir") if isinstance(payload, dict) else None
        if not isinstance(location, str) or not is_object_store_url(location):
            await self.app(scope, _replay(body, receive), send)
            return
        assert isinstance(payload, dict)
        self.locations.append(location)
        bucket, prefix = split_s3_url(location)
        restoring = path.endswith("/restore")
        where = f"restore-{next(self._restores)}" if restoring else "commit"
        local = self.mirror / where / bucket / prefix
        if restoring:
            await anyio.to_thread.run_sync(download_checkpoint, location, local)
        body = json.dumps({**payload, "checkpoint_dir": str(local)}).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await self.app({**scope, "headers": headers}, _replay(body, receive), hold)
        status = next((m["status"] for m in held if m["type"] == "http.response.start"), 0)
        if not restoring and status == 200:
            await anyio.to_thread.run_sync(upload_share, local, location)
        for message in held:
            await send(message)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app ``body`` once, then waits on the real one."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
