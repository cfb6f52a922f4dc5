"""The checkpoint store on S3 through ``obstore``: conditional puts instead of renames (D327, D328).

S3 has no rename and no hard link, but a put can be conditional: ``If-None-Match: *`` creates an
object only if the key is free, ``If-Match: <etag>`` replaces only the version read. ``create``
and ``publish_file`` use the first, ``replace_if`` the second. A put is atomic: a reader sees the
whole object or none, so there is no temp object to clean up after a crash.

A retried conditional put whose first try succeeded but whose answer was lost is refused by the
object it wrote; both conditional writes therefore read the object back when refused and count
bytes equal to theirs as their own write, which keeps every retry idempotent.

Endpoint, region and credentials come from the ``AWS_*`` environment (``AWS_ENDPOINT_URL``,
``AWS_ALLOW_HTTP`` for a local server, ``AWS_ACCESS_KEY_ID``, …), as every S3 client reads them.
Every request has a deadline (``REQUEST_TIMEOUT``) and a bounded retry budget.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from .interface import ObjectMissingError, StoredObject, StoreError, split_s3_url, store_key

try:
    import obstore
    from obstore.exceptions import (
        AlreadyExistsError,
        BaseError,
        NotFoundError,
        PreconditionError,
    )
    from obstore.store import S3Store
except ImportError as exc:  # pragma: no cover - the s3 extra is installed by the test target
    raise ValueError(
        "s3:// checkpoint stores need the s3 extra: pip install 'midflight[s3]'"
    ) from exc

REQUEST_TIMEOUT: Final = "30s"
CONNECT_TIMEOUT: Final = "5s"
RETRIES: Final = 3
READ_CHUNK: Final = 1 << 20
DELETE_BATCH: Final = 1000
"""Keys per DeleteObjects request (S3's limit)."""

_CLIENT_ENV: Final = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_ALLOW_HTTP")
_clients: dict[tuple[str, ...], S3Store] = {}
_clients_lock = threading.Lock()


def _client(bucket: str) -> S3Store:
    """One client per bucket, endpoint and key in a process: its pool serves every store there."""
    key = (bucket, *(os.environ.get(name, "") for name in _CLIENT_ENV))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = S3Store(
                bucket,
                client_options={
                    "timeout": REQUEST_TIMEOUT,
                    "connect_timeout": CONNECT_TIMEOUT,
                    # Client options replace those read from the environment: keep this one.
                    "allow_http": os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true",
                },
                retry_config={
                    "max_retries": RETRIES,
                    "retry_timeout": timedelta(seconds=60),
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=50),
                        "max_backoff": timedelta(seconds=2),
                        "base": 2,
                    },
                },
            )
            _clients[key] = client
        return client


@contextlib.contextmanager
def _translated(where: str) -> Iterator[None]:
    """obstore's errors as the store's: a missing key, or a failed request (first line only)."""
    try:
        yield
    except (NotFoundError, FileNotFoundError) as exc:
        raise ObjectMissingError(f"{where} does not exist") from exc
    except BaseError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"{where}: {first[:300]}") from exc


class S3CheckpointStore:
    """A :class:`~protocols.CheckpointStore` under ``s3://bucket/prefix``."""

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = split_s3_url(url)
        self._client = _client(self.bucket)

    @property
    def url(self) -> str:
        """``s3://bucket/prefix`` (no trailing slash)."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _path(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, store_key(key) if key else "") if p)

    def describe(self, key: str) -> str:
        """The object's ``s3://`` URL."""
        return f"s3://{self.bucket}/{self._path(key)}"

    def exists(self, key: str) -> bool:
        """A HEAD request."""
        try:
            with _translated(self.describe(key)):
                obstore.head(self._client, self._path(key))
        except ObjectMissingError:
            return False
        return True

    def read(self, key: str) -> bytes:
        """The object's bytes."""
        with _translated(self.describe(key)):
            return bytes(obstore.get(self._client, self._path(key)).bytes())

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag; ``None`` when absent."""
        try:
            with _translated(self.describe(key)):
                result = obstore.get(self._client, self._path(key))
                data = bytes(result.bytes())
        except ObjectMissingError:
            return None
        etag = result.meta["e_tag"]
        if etag is None:
            raise StoreError(f"{self.describe(key)}: the server gave no ETag to compare with")
        return data, etag

    def lines(self, key: str) -> Iterator[bytes]:
        """The object's lines, streamed in chunks of at least 1 MiB."""
        where = self.describe(key)
        with _translated(where):
            stream = obstore.get(self._client, self._path(key)).stream(min_chunk_size=READ_CHUNK)
        rest = b""
        with _translated(where):
            for chunk in stream:
                lines = (rest + bytes(chunk)).split(b"\n")
                rest = lines.pop()
                for line in lines:
                    yield line + b"\n"
        if rest:
            yield rest

    def spool_directory(self, prefix: str) -> Path:
        """A local temporary directory: the file is uploaded from there."""
        return Path(tempfile.gettempdir())

    def publish_file(self, key: str, source: Path) -> None:
        """Upload ``source`` only if the key is free (a twin already there is kept)."""
        try:
            with _translated(self.describe(key)):
                obstore.put(self._client, self._path(key), source, mode="create")
        except StoreError as exc:
            if not isinstance(exc.__cause__, AlreadyExistsError | PreconditionError):
                raise
        finally:
            source.unlink(missing_ok=True)

    def create(self, key: str, data: bytes) -> bool:
        """``If-None-Match: *``; False when another object holds the key."""
        try:
            with _translated(self.describe(key)):
                obstore.put(self._client, self._path(key), data, mode="create")
        except StoreError as exc:
            if not isinstance(exc.__cause__, AlreadyExistsError | PreconditionError):
                raise
            return self._holds(key, data)  # our own earlier try, answered too late, counts
        return True

    def replace(self, key: str, data: bytes) -> None:
        """An unconditional put (atomic on S3)."""
        with _translated(self.describe(key)):
            obstore.put(self._client, self._path(key), data, mode="overwrite")

    def replace_if(self, key: str, data: bytes, version: str | None) -> bool:
        """``If-Match: <etag>``, or ``If-None-Match: *`` when the key was absent."""
        if version is None:
            return self.create(key, data)
        mode: Any = {"e_tag": version}
        try:
            with _translated(self.describe(key)):
                obstore.put(self._client, self._path(key), data, mode=mode)
        except StoreError as exc:
            if not isinstance(exc.__cause__, PreconditionError | AlreadyExistsError):
                raise
            return self._holds(key, data)
        except ObjectMissingError:
            return False  # deleted since it was read: moved, as far as this writer knows
        return True

    def _holds(self, key: str, data: bytes) -> bool:
        current = self.read_versioned(key)
        return current is not None and current[0] == data

    def list_objects(self, prefix: str) -> list[StoredObject]:
        """A paginated LIST of the prefix."""
        base = self._path(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        found: list[StoredObject] = []
        with _translated(self.describe(prefix)):
            for batch in obstore.list(self._client, prefix=base or None):
                for meta in batch:
                    found.append(
                        StoredObject(
                            key=meta["path"][strip:],
                            size=int(meta["size"]),
                            modified=meta["last_modified"].timestamp(),
                        )
                    )
        return sorted(found, key=lambda o: o.key)

    def subdirectories(self, prefix: str) -> list[str]:
        """A LIST with ``/`` as delimiter: the common prefixes' last segments."""
        base = self._path(prefix)
        with _translated(self.describe(prefix)):
            listed = obstore.list_with_delimiter(self._client, prefix=base or None)
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in listed["common_prefixes"])
        return sorted(n for n in names if not n.startswith("."))

    def delete(self, keys: Iterable[str]) -> None:
        """DeleteObjects in batches; S3 answers a missing key as deleted."""
        paths = [self._path(key) for key in keys]
        for start in range(0, len(paths), DELETE_BATCH):
            with _translated(self.describe("")):
                obstore.delete(self._client, paths[start : start + DELETE_BATCH])

    def delete_tree(self, prefix: str) -> None:
        """LIST the prefix, then delete what it holds."""
        self.delete(o.key for o in self.list_objects(prefix))
