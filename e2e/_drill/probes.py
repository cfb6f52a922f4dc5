"""Stale probes: one late request of an attempt to every participant kind.

After a restore fences attempt N, and after a retire, the drill's controllers send each kind one
request of the refused attempt and log the answer; every one must be ``stale_attempt``. The table
lives here once, for the drill's driver and the sequence driver alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import anyio
import httpx

from protocols import EpisodeId

from .._servers.cluster import Cluster
from .plan import error_code

ResourcesProbe = Literal["tool", "seed"]
"""``tool``: a tool call on the session; ``seed``: ``seed_session``, which needs no session, so only
the retire mark can refuse it."""

Probe = tuple[str, dict[str, Any], dict[str, str]]
"""URL, JSON body and headers of one probe."""


def probe_requests(
    cluster: Cluster, episode: EpisodeId, task: Mapping[str, Any], resources: ResourcesProbe
) -> dict[str, Probe]:
    """Participant kind → the late request of ``episode`` sent to it (``task``: its ``/run`` task)."""
    key = episode.capture_key
    if resources == "tool":
        resources_probe: Probe = (
            cluster.url_of("resources") + f"/ng-rollout/{key}/tools/add",
            {"arg": 1},
            {},
        )
    else:
        resources_probe = (
            cluster.url_of("resources") + f"/ng-rollout/{key}/seed_session",
            {"task_input": task["task_input"]},
            {},
        )
    return {
        "environment": (
            cluster.url_of("environment") + "/run",
            {"episode_id": episode.model_dump(), "task": dict(task)},
            {},
        ),
        "agent": (
            cluster.url_of("agent") + f"/ng-rollout/{key}/sessions/activate",
            {},
            {"x-ng-agent-activation": "1"},
        ),
        "resources": resources_probe,
        "model": (
            cluster.url_of("model") + f"/ng-rollout/{key}/v1/chat/completions",
            {"messages": [{"role": "user", "content": "late"}], "max_tokens": 1},
            {},
        ),
    }


async def send_probes(
    http: httpx.AsyncClient,
    cluster: Cluster,
    episode: EpisodeId,
    task: dict[str, Any],
    resources: ResourcesProbe,
    within: float,
) -> dict[str, tuple[int, str | None]]:
    """Send every kind its late request of ``episode``; ``(status, error code)`` per kind."""
    answers: dict[str, tuple[int, str | None]] = {}
    for kind, (url, body, headers) in probe_requests(cluster, episode, task, resources).items():
        with anyio.fail_after(within):
            reply = await http.post(url, json=body, headers=headers)
        answers[kind] = (reply.status_code, error_code(reply))
    return answers
