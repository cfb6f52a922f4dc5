"""What each participant server says a control operation cost it, read from its ``/metrics``.

A restore's ``restore_s`` is the controller's wall time: the request built and sent to every
participant at once, each one's restore, the replies, and the resume. The participants run side
by side, so that figure alone does not say which of them the restore waited for. Every server
already times each control operation it handles (``midflight_checkpoint_operation_seconds``,
from the route's start of work to its reply, without the HTTP request's parse); a bench reads
that histogram's sum from each server after the operation, the way an operator's Prometheus
would, through the same transport its controller used (D453).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from coordinator import Member

DURATIONS = "midflight_checkpoint_operation_seconds"
"""The histogram every participant server keeps of its control operations' durations."""
TIMEOUT_SECONDS = 30.0


def seconds_in(metrics_text: str, operation: str) -> float:
    """The seconds ``operation`` took in all (every outcome) in one server's metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != DURATIONS:
            continue
        for sample in family.samples:
            if sample.name == f"{DURATIONS}_sum" and sample.labels.get("operation") == operation:
                total += sample.value
    return total


async def server_seconds(
    members: Iterable[Member],
    operation: str,
    transport_of: Callable[[str], httpx.AsyncBaseTransport | None],
) -> dict[str, float]:
    """Server name → the seconds it spent in ``operation`` so far, read from its ``/metrics``.

    Args:
        members: The participants, as the coordinator discovered them.
        operation: A control operation (``restore``, ``commit``, …).
        transport_of: The transport to reach a member's URL (``None``: the network).

    Raises:
        httpx.HTTPError: A server did not answer, or answered with an error.
    """
    seconds: dict[str, float] = {}
    for member in members:
        async with httpx.AsyncClient(
            transport=transport_of(member.url), timeout=TIMEOUT_SECONDS
        ) as client:
            reply = await client.get(f"{member.url}/metrics")
            reply.raise_for_status()
        seconds[member.instance] = round(seconds_in(reply.text, operation), 4)
    return seconds
