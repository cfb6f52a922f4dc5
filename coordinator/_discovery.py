"""Discovery: ask each server's status route what kind of participant it is, if any."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import httpx
from tenacity.wait import wait_base

from protocols import PREPARE_ORDER

from ._client import STATUS_TIMEOUT_SECONDS, ControlClient, NotAParticipantError
from ._fixed_order import NO_MODEL
from ._members import CoordinationError, Member, describe, each

DISCOVERY_ATTEMPTS: Final = 3
"""Tries per status probe when the connection fails, as in the reference."""


async def discover(
    urls: Iterable[str],
    *,
    token: str,
    transport: httpx.AsyncBaseTransport | None = None,
    wait: wait_base | None = None,
    probe_timeout: float = STATUS_TIMEOUT_SECONDS,
) -> list[Member]:
    """The participants among ``urls``, sorted by (``PREPARE_ORDER`` index, server name).

    A server that answers 404 on the status route has no control routes and is left out.

    Args:
        urls: Root URLs of the servers to probe (duplicates are probed once).
        token: The control token.
        transport: An httpx transport shared by every client (tests route it in-process).
        wait: Pause between probe attempts (a tenacity wait strategy).
        probe_timeout: Cap of one status probe, in seconds.

    Raises:
        CoordinationError: A probe failed, a server is of an unknown kind, two servers share a
            name, or no participant of kind ``model`` exists (``failures["deployment"]``).
    """
    clients = {
        url.rstrip("/"): ControlClient(
            url, token=token, transport=transport, attempts=DISCOVERY_ATTEMPTS, wait=wait
        )
        for url in urls
    }
    probes = [
        Member(kind="model", instance=url, url=url, client=client)
        for url, client in clients.items()
    ]  # placeholders: _each keys results by instance, here the URL
    statuses, failures = await each(
        "status", probes, lambda m: m.client.status(probe_seconds=probe_timeout)
    )
    members: list[Member] = []
    errors: dict[str, BaseException] = {}
    for url, error in failures.items():
        if not isinstance(error, NotAParticipantError):
            errors[url] = error
    seen: dict[str, str] = {}
    for url, status in statuses.items():
        if status.instance in seen:
            errors[url] = ValueError(
                f"server name {status.instance!r} also used by {seen[status.instance]}"
            )
            continue
        seen[status.instance] = url
        members.append(Member(status.kind, status.instance, url, clients[url]))
    keep = {member.url for member in members} if not errors else set()
    for url, client in clients.items():
        if url not in keep:
            await client.aclose()
    if errors:
        raise CoordinationError(
            "discover", {url: describe(exc) for url, exc in errors.items()}, errors
        )
    if not any(member.kind == "model" for member in members):
        for member in members:
            await member.client.aclose()
        raise CoordinationError("discover", {"deployment": NO_MODEL})
    return sorted(members, key=lambda m: (PREPARE_ORDER.index(m.kind), m.instance))
