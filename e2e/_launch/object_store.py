"""A real S3 API on 127.0.0.1 for the drill and the tests: moto's server, in a thread (D329).

moto's ``ThreadedMotoServer`` answers the S3 REST API, conditional puts included, from a
werkzeug server thread. Its handlers check a condition and then store, without a lock, so two
concurrent conditional puts could both pass; S3 itself makes each request atomic. This server
therefore runs one request at a time, which is what S3 promises per key and all a test needs. It
binds port 0, creates its bucket, and stops with the context that started it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Final, Self

import httpx

BUCKET: Final = "midflight"
REGION: Final = "us-east-1"
KEY_ID: Final = "midflight-local"
"""Credentials of the local server: moto accepts any pair, a client must sign with one."""


class _OneAtATime:
    """A WSGI middleware that lets one request into the app at a time (atomic like S3)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with self._lock:
            return list(self._app(environ, start_response))  # the body is read under the lock


class LocalS3:
    """moto's S3 API on ``127.0.0.1:<free port>`` with one bucket, as a context manager.

    Attributes:
        endpoint: ``http://127.0.0.1:<port>`` once started.
        bucket: The bucket it created.
    """

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.endpoint = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``: a checkpoint store location on this server."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def environment(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point an S3 client (obstore's included) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": KEY_ID,
        }

    def start(self) -> Self:
        """Serve, create the bucket, and return once both are done (bounded)."""
        try:
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                MotoRequestHandler,
                create_backend_app,
            )
            from werkzeug.serving import make_server
        except ImportError as exc:
            raise RuntimeError(
                "a local S3 server needs moto: pip install 'midflight[s3-local]'"
            ) from exc
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        app = _OneAtATime(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            "127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler
        )
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="midflight-local-s3", daemon=True
        )
        self._thread.start()
        reply = httpx.put(f"{self.endpoint}/{self.bucket}", timeout=10.0)
        if reply.status_code not in (200, 409):
            self.stop()
            raise RuntimeError(f"the local S3 server refused bucket {self.bucket}: {reply.text}")
        return self

    def object_keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under ``prefix``, read through the S3 API (a ListObjectsV2)."""
        keys: list[str] = []
        token: str | None = None
        while True:
            params = {"list-type": "2", "prefix": prefix}
            if token:
                params["continuation-token"] = token
            reply = httpx.get(f"{self.endpoint}/{self.bucket}", params=params, timeout=10.0)
            reply.raise_for_status()
            text = reply.text
            keys += [part.split("</Key>")[0] for part in text.split("<Key>")[1:]]
            if "<IsTruncated>true</IsTruncated>" not in text:
                return keys
            token = text.split("<NextContinuationToken>")[1].split("</NextContinuationToken>")[0]

    def stop(self) -> None:
        """Shut the server down and wait for its thread (bounded)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
