"""Every reference server hosted in a Ray actor on a local head; a participant's Ray worker
process killed while a checkpoint is open.

The servers run inside named actors (``max_restarts=0``), driven from the test's event loop over
HTTP as in ``test_scenarios.py``. Killing the agent's actor process (the Ray worker process that
runs it) while a checkpoint is prepared makes the coordinator's commit fail naming that agent
and nothing else; the next restore, into fresh actors, continues the rollout from the checkpoint
before, token for token.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from coordinator import CoordinationError, discover_on_ray
from e2e._launch.ray_head import RayHead, is_running, wait_gone
from e2e._launch.ray_host import RayHost
from e2e._launch.supervisor import Supervisor

from .deployment import TOKEN, attached, ep, start_deployment
from .test_scenarios import THREE_CALLS, doomed, finish, tidy

pytestmark = [pytest.mark.process, pytest.mark.anyio, pytest.mark.timeout(600)]
NAMESPACE = "midflight-test-hosting"


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    head = RayHead(log_path=tmp_path_factory.mktemp("ray") / "head.log")
    head.start()
    try:
        yield head
    finally:
        assert head.stop() == []
        assert head.processes() == []  # no process of the head outlived it


@pytest.fixture(scope="module")
def ray_host(ray_head: RayHead) -> Iterator[RayHost]:
    with RayHost(ray_head.address, ray_head.env, NAMESPACE) as host:
        yield host


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory, ray_host: RayHost) -> Iterator[Supervisor]:
    # The resources server runs two shard processes: children of its actor's process.
    started = start_deployment(
        tmp_path_factory.mktemp("ray-hosted") / "run",
        resources={"mode": "exported", "verify": "wait", "workers": 2},
        host=ray_host,
    )
    try:
        yield started
    finally:
        started.kill_all()


def stays_dead(handle: object, seconds: float = 8.0) -> None:
    """Every call on the actor for ``seconds`` fails with ``ActorDiedError``."""
    import ray

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(handle.describe.remote(), timeout=30)  # type: ignore[attr-defined]
        time.sleep(0.5)


async def test_the_coordinator_discovers_the_hosted_participants_from_ray(
    supervisor: Supervisor, ray_host: RayHost
) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class NotAServer:
        def ping(self) -> str:
            return "pong"

    other = NotAServer.options(name="not-a-server", namespace=NAMESPACE).remote()
    try:
        assert ray.get(other.ping.remote(), timeout=60) == "pong"
        members = await discover_on_ray(NAMESPACE, token=TOKEN)
        # The worker has no control routes and the plain actor no describe(): both left out.
        assert [(m.kind, m.instance) for m in members] == [
            ("environment", "environment"),
            ("model", "policy"),
            ("agent", "agent"),
            ("resources", "resources"),
        ]
        assert {m.url for m in members} == {
            url for name, url in supervisor.urls.items() if name != "worker"
        }
        for member in members:
            await member.client.aclose()
    finally:
        ray.kill(other)


async def test_a_killed_ray_worker_process_fails_the_open_checkpoint_and_a_restore_recovers(
    supervisor: Supervisor, ray_host: RayHost
) -> None:
    scope = [ep("hosted", 0)]
    async with attached(supervisor, THREE_CALLS) as deployed:
        async with anyio.create_task_group() as group:
            group.start_soon(doomed, deployed, "hosted", 0)
            with anyio.fail_after(60):  # one call delivered, the next one generating
                while not any(e["capture_key"] == "hosted" for e in deployed.egress()):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await deployed.model_in_flight()
            committed = await deployed.checkpoint("hosted-c1", scope)
            assert committed["environment"] == ["hosted"]
            prepared = await deployed.control.prepare("hosted-c2", deployed.deadline())
            assert prepared.prepared  # the second checkpoint is open
            agent = supervisor.processes["agent"]
            os.kill(agent.pid, signal.SIGKILL)  # the Ray worker process running the agent
            assert await anyio.to_thread.run_sync(wait_gone, [agent.pid], 30.0) == []
            with pytest.raises(CoordinationError) as caught:
                await deployed.control.commit(
                    "hosted-c2", deployed.deadline(), deployed.checkpoint_dir("hosted-c2"), scope
                )
            assert set(caught.value.failures) == {"agent"}, caught.value.failures
            # Ray brings nothing back (max_restarts=0): the actor is dead for good, not
            # restarting (a restarting actor answers ActorUnavailableError, then again).
            await anyio.to_thread.run_sync(stays_dead, agent.handle)
            killed_before = len(ray_host.killed)
            await deployed.crash()  # every actor's processes SIGKILLed; fresh actors
        killed = ray_host.killed[killed_before:]
        assert len(killed) == len(supervisor.urls) and all(
            not is_running(pid) for pids in killed for pid in pids
        )
        # One process per server, but three for resources: its actor's and its two shards'.
        assert sorted(len(pids) for pids in killed) == [1, 1, 1, 1, 3], killed
        assert not Path(deployed.checkpoint_dir("hosted-c2"), "checkpoint.json").exists()
        assert await deployed.restore("hosted-r1", "hosted-c1", scope) == ["hosted-a1"]
        await finish(deployed, "hosted", 1)  # the contract's result and tokens, as attempt 1
        await tidy(deployed, ep("hosted", 1))
