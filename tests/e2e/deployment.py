"""A small reference deployment of real server processes for the scenario tests.

``deployment()`` starts every role (worker, policy, resources, agent, environment) through the
supervisor on 127.0.0.1, each in its own process group, and yields a :class:`Deployment` that
drives episodes, the control plane and SIGKILL crashes from the test's event loop. Expected results
come from the contract alone (``expected_result``), never from a run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

from coordinator import Coordinator
from e2e._drill.control import ControlSession
from e2e._drill.tokens_of import token_sequence
from e2e._launch.supervisor import ExtraServer, ServerHost, Supervisor, SupervisorOptions
from e2e._servers.cluster import Role, read_cluster
from e2e._servers.context import LEASE_GRACE_ENV
from e2e._servers.model import read_policy_evidence
from protocols import CONTROL_PREFIX, EpisodeId, encode, render_prompt

from .agent_fakes import completion, counter_tool_step

TOKEN = "scenario-token"
TASK: dict[str, int] = {"activations": 2, "turns": 1, "max_tokens": 24, "seed": 0}
"""Two activations of one turn: small, yet with a boundary between the activations."""
WAIT_SECONDS = 60.0
"""The bound of every wait on another process (it asserts nothing about speed)."""


def expected_episode(rollout_id: str, task: Mapping[str, int]) -> tuple[dict[str, Any], list[int]]:
    """The result and the final token sequence the contract fixes for one rollout."""
    conversation = [
        {"role": "system", "content": "counter"},
        {"role": "user", "content": f"{rollout_id} {task['seed']}"},
    ]
    value, notes = 1, []
    last: list[int] = []
    for _ in range(task["activations"] * task["turns"]):
        content = completion(0, conversation, task["max_tokens"])
        last = encode(render_prompt(conversation)) + encode(content)
        conversation.append({"role": "assistant", "content": content})
        value, tool_reply = counter_tool_step(content, value, notes)
        conversation.append({"role": "tool", "content": tool_reply})
    calls = task["activations"] * task["turns"]
    result = {
        "reward": (value + 7 * sum(notes)) % 101 / 100,
        "model_calls": calls,
        "tool_calls": calls,
    }
    return result, last


def ep(rollout: str, attempt: int = 0) -> EpisodeId:
    """The episode id of ``rollout``'s attempt."""
    return EpisodeId(rollout_id=rollout, attempt=attempt)


def error_code(reply: httpx.Response) -> str | None:
    """The ``error.code`` of a refusal, or None."""
    if reply.status_code < 400:
        return None
    body = reply.json()
    return str(body["error"]["code"])


class Deployment:
    """Every reference server as a real process, driven from one event loop."""

    def __init__(self, root: Path, supervisor: Supervisor, task: Mapping[str, int]) -> None:
        self.root = root
        self.supervisor = supervisor
        self.task = dict(task)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))
        self.auth = {"Authorization": f"Bearer {TOKEN}"}
        self.control = ControlSession(read_cluster(supervisor.cluster_path), TOKEN)

    def url(self, role: Role) -> str:
        """The URL of the (current) server of ``role``."""
        return self.control.cluster.url_of(role)

    def url_named(self, name: str) -> str:
        """The URL of the (current) server called ``name`` (an extra server, say)."""
        (url,) = [s.url for s in self.control.cluster.servers if s.name == name]
        return url

    async def coordinator(self) -> Coordinator:
        """The coordinator over every participant of the current processes."""
        return await self.control.coordinator()

    def run_body(self, rollout: str, attempt: int) -> dict[str, Any]:
        """The ``/run`` body of one attempt of the counter task."""
        episode = EpisodeId(rollout_id=rollout, attempt=attempt)
        return {
            "episode_id": episode.model_dump(),
            "task": {
                "task_id": {"taskset": "counter", "task_id": rollout},
                "task_input": self.task,
            },
        }

    async def run(self, rollout: str, attempt: int, server: str | None = None) -> httpx.Response:
        """``POST /run`` once (on the environment server called ``server``); the raw reply."""
        base = self.url("environment") if server is None else self.url_named(server)
        return await self.http.post(base + "/run", json=self.run_body(rollout, attempt))

    async def metric(self, server: str, name: str, **labels: str) -> float:
        """One sample of a server's ``/metrics`` (0 when the series is absent)."""
        reply = await self.http.get(self.url_named(server) + "/metrics")
        reply.raise_for_status()
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        head = f"{name}{{{wanted}}}" if labels else name
        for line in reply.text.splitlines():
            if line.startswith(head + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def status(self, role: Role) -> dict[str, Any]:
        """A participant's control status."""
        reply = await self.http.get(self.url(role) + f"{CONTROL_PREFIX}/status", headers=self.auth)
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    async def until(self, role: Role, predicate: Any, what: str) -> dict[str, Any]:
        """Poll ``role``'s status (another process: polling is the only way) until ``predicate``."""
        with anyio.fail_after(WAIT_SECONDS):
            while True:
                status = await self.status(role)
                if predicate(status):
                    return status
                await anyio.sleep(0.02)
        raise AssertionError(what)  # pragma: no cover - fail_after raises first

    async def model_in_flight(self, count: int = 1) -> None:
        """Wait until the policy server has ``count`` calls generating."""
        await self.until(
            "model", lambda s: s["report"]["counts"].get("inflight", 0) >= count, "model calls"
        )

    def deadline(self) -> float:
        """A deadline for one control operation."""
        return time.time() + 30.0

    def checkpoint_dir(self, checkpoint_id: str) -> Path:
        """Where a checkpoint of this run is committed."""
        return Path(self.control.checkpoint_dir(self.root, checkpoint_id))

    async def checkpoint(
        self, checkpoint_id: str, scope: list[EpisodeId], *, resume: bool = True
    ) -> dict[str, list[str]]:
        """Prepare, commit ``scope``, optionally resume; each kind's committed capture keys."""
        prepared = await self.control.prepare(checkpoint_id, self.deadline())
        assert prepared.prepared, prepared
        outcome = await self.control.commit(
            checkpoint_id, self.deadline(), self.checkpoint_dir(checkpoint_id), scope
        )
        if resume:
            await self.control.resume(checkpoint_id, self.deadline())
        return {outcome.kinds[name]: list(r.episode_ids) for name, r in outcome.replies.items()}

    async def restore(
        self, restore_id: str, checkpoint_id: str, scope: list[EpisodeId]
    ) -> list[str]:
        """Restore ``scope`` from a checkpoint and resume; the environment's restored keys."""
        restored = await self.control.restore(
            restore_id, self.deadline(), self.checkpoint_dir(checkpoint_id), scope
        )
        await self.control.resume(restore_id, self.deadline())
        return restored

    async def crash(self) -> None:
        """SIGKILL every server's process group, then start fresh processes on the same root."""
        await self.close_control()
        await anyio.to_thread.run_sync(self.supervisor.restart_all)
        self.control = ControlSession(read_cluster(self.supervisor.cluster_path), TOKEN)

    async def close_control(self) -> None:
        """Close the control session's connections (the processes are about to go)."""
        await self.control.aclose()

    def egress(self) -> list[dict[str, Any]]:
        """The policy server's egress evidence (delivered responses), in order."""
        return read_policy_evidence(self.root)

    async def tokens(self, capture_key: str) -> list[int]:
        """The final token sequence of an attempt: its ledger manifest and the staging store."""
        manifest = await self.control.ledger_manifest(capture_key)
        assert manifest is not None, f"{capture_key}: its ledger is retired"
        return token_sequence(manifest["records"], self.root / "staging")


LEASE_GRACE_SECONDS = 3.0
"""The servers' lease grace (``MIDFLIGHT_LEASE_GRACE_SECONDS``): short, so a lease can expire."""


def start_deployment(
    root: Path,
    *,
    token_delay_ms: float = 15.0,
    resources: Mapping[str, Any] | None = None,
    extra_servers: tuple[ExtraServer, ...] = (),
    host: ServerHost | None = None,
) -> Supervisor:
    """Start every role under ``root`` (each in its own process group); the caller kills them.

    Args:
        root: The run root.
        token_delay_ms: The worker's delay per token.
        resources: Options of the resources server (default: exported, verify waited for).
        extra_servers: More servers (a second chain of agent and environment, say).
        host: Where the servers run (Ray actors, say); processes here by default.
    """
    options = SupervisorOptions(
        role_options={
            "worker": {"token_delay_ms": token_delay_ms, "seed": 0},
            "resources": dict(resources or {"mode": "exported", "verify": "wait"}),
        },
        env={LEASE_GRACE_ENV: str(LEASE_GRACE_SECONDS)},
        extra_servers=extra_servers,
    )
    supervisor = Supervisor(root.resolve(), TOKEN, options, host=host)
    supervisor.start_all()
    return supervisor


@asynccontextmanager
async def attached(
    supervisor: Supervisor, task: Mapping[str, int] = TASK
) -> AsyncIterator[Deployment]:
    """Drive the running deployment of ``supervisor`` from this test's event loop."""
    deployed = Deployment(supervisor.root, supervisor, task)
    try:
        yield deployed
    finally:
        await deployed.close_control()
        await deployed.http.aclose()
