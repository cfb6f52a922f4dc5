"""Discovery from Ray: the participants hosted as named actors in one Ray namespace.

A server hosted on Ray is a named actor whose ``describe()`` method answers a
:class:`HostedServer` (its name, role and URL). The coordinator lists the named actors of the
namespace, asks each one, and probes the URLs as :func:`discover` does for a cluster file's; the
control calls themselves still go over HTTP to those URLs (D338). Ray is an optional extra
(``midflight[ray]``); it is imported only here, when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._discovery import discover
from ._members import CoordinationError, Member

DESCRIBE_METHOD: Final = "describe"
"""The method every hosted server's actor answers with its :class:`HostedServer`."""
DESCRIBE_TIMEOUT_S: Final = 30.0


class HostedServer(BaseModel):
    """What a server hosted on Ray says of itself.

    Attributes:
        name: The server's name (a participant's instance).
        role: ``environment``, ``agent``, ``resources``, ``model`` or ``worker``.
        url: Its root URL.
        options: The role options it was started with.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    role: str = Field(min_length=1)
    url: str = Field(min_length=1)
    options: Mapping[str, Any] = Field(default_factory=dict)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise CoordinationError(
            "discover", {"ray": "Ray is not installed: pip install 'midflight[ray]'"}
        ) from exc
    return ray


def hosted_on_ray(
    namespace: str, *, address: str | None = None, timeout: float = DESCRIBE_TIMEOUT_S
) -> list[HostedServer]:
    """Every server hosted in the Ray namespace ``namespace``, sorted by name.

    Connects to Ray first when this process is not connected (``address``, else ``RAY_ADDRESS``).
    A named actor without a ``describe`` method is not a hosted server and is left out.

    Raises:
        CoordinationError: Ray is not installed, or an actor did not describe itself in time
            (``failures`` names it).
    """
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    listed = ray.util.list_named_actors(all_namespaces=True)
    handles = {}
    for entry in listed:
        if entry["namespace"] != namespace:
            continue
        handle = ray.get_actor(entry["name"], namespace=namespace)
        method = getattr(handle, DESCRIBE_METHOD, None)
        if method is not None:
            handles[entry["name"]] = method.remote()
    servers: list[HostedServer] = []
    failures: dict[str, str] = {}
    for name, ref in handles.items():
        try:
            servers.append(HostedServer.model_validate(ray.get(ref, timeout=timeout)))
        except ValidationError as exc:
            failures[name] = f"describe() answered no hosted server: {exc.errors()[0]['msg']}"
        except Exception as exc:  # a dead or stuck actor: Ray's own error types
            failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if failures:
        raise CoordinationError("discover", failures)
    return sorted(servers, key=lambda server: server.name)


async def discover_on_ray(
    namespace: str,
    *,
    token: str,
    address: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Member]:
    """The participants hosted in the Ray namespace ``namespace``, as :func:`discover` finds
    them (an inference worker, which has no control routes, is left out).

    Raises:
        CoordinationError: As :func:`hosted_on_ray` and :func:`discover`.
    """
    servers = await anyio.to_thread.run_sync(lambda: hosted_on_ray(namespace, address=address))
    return await discover([server.url for server in servers], token=token, transport=transport)


__all__ = ["DESCRIBE_METHOD", "HostedServer", "discover_on_ray", "hosted_on_ray"]
