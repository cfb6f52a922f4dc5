"""Process-level scenarios of step modes: verify waited for or replayed, restart-only rollouts.

One deployment per module runs two chains side by side, each a real server process:

- the base chain (environment → agent → resources) whose resources server declares
  ``verify = wait``;
- a replay chain (``environment-replay`` → ``agent-replay`` → ``resources-replay``) whose
  resources server declares ``verify = replay``;
- a restart-only chain (``environment-restart`` → ``agent-restart``).

All share the policy and worker servers. Each resources server counts its verifies on
``/metrics`` (``midflight_resources_requests_total`` and ``…_in_progress``), which is how these
tests see a verify held by a checkpoint, running through one, or run again after a restore.

Both resources servers hold each verify until the test drops a file named by its capture key
(``--verify-hold-dir``), so a test decides when a verify ends instead of racing a timer on a busy
machine. The verify of the base chain is also the episode's last step, so these tests show an
episode that finishes during prepare, without a crash (its result waits for resume) and with one
(the restored attempt returns the recorded reward without verifying again).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from e2e._launch.supervisor import ExtraServer, Supervisor
from protocols import EpisodeId

from .deployment import (
    TASK,
    WAIT_SECONDS,
    Deployment,
    attached,
    ep,
    expected_episode,
    start_deployment,
)

pytestmark = [pytest.mark.process, pytest.mark.anyio]

REPLAY_CHAIN = ("environment-replay", "agent-replay", "resources-replay")
HOLD = "verify-hold"
"""Under the run root: a verify waits until a file named by its capture key appears here."""
IN_PROGRESS = "midflight_resources_requests_in_progress"
FINISHED = "midflight_resources_requests_total"


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    root = tmp_path_factory.mktemp("steps") / "run"
    hold = root / HOLD
    hold.mkdir(parents=True)
    environment, agent, resources = REPLAY_CHAIN
    extra = (
        ExtraServer(
            resources,
            "resources",
            {"mode": "exported", "verify": "replay", "verify_hold_dir": str(hold)},
        ),
        ExtraServer(agent, "agent", peers={"resources": resources}),
        ExtraServer(environment, "environment", peers={"agent": agent, "resources": resources}),
        # The restart-only chain verifies on the replay server, so a held verify keeps its episode
        # live without holding any checkpoint.
        ExtraServer("agent-restart", "agent", {"restart_only": True}, {"resources": resources}),
        ExtraServer(
            "environment-restart",
            "environment",
            peers={"agent": "agent-restart", "resources": resources},
        ),
    )
    started = start_deployment(
        root,
        resources={"mode": "exported", "verify": "wait", "verify_hold_dir": str(hold)},
        extra_servers=extra,
    )
    try:
        yield started
    finally:
        started.kill_all()


def release(deployed: Deployment, *keys: str) -> None:
    """Let the verify of each capture key end (now, or as soon as it starts)."""
    for key in keys:
        (deployed.root / HOLD / key).touch()


async def verifies(deployed: Deployment, server: str) -> tuple[float, float]:
    """``server``'s verifies: (in progress, finished ok)."""
    running = await deployed.metric(server, IN_PROGRESS, route="verify")
    done = await deployed.metric(server, FINISHED, route="verify", outcome="ok")
    return running, done


async def until_verifying(deployed: Deployment, server: str) -> None:
    """Wait until ``server`` is serving a verify."""
    with anyio.fail_after(WAIT_SECONDS):
        while (await verifies(deployed, server))[0] < 1:  # noqa: ASYNC110 - another process
            await anyio.sleep(0.02)


def exported_boundaries(directory: Path) -> dict[str, str | None]:
    """Capture key → the ``next`` of the boundary each environment server exported."""
    found: dict[str, str | None] = {}
    for records in directory.glob("gym/environment/*/records-*.jsonl"):
        for line in records.read_bytes().splitlines():
            record = json.loads(line)
            key = EpisodeId.model_validate(record["episode_id"]).capture_key
            boundary = record["boundary"]
            found[key] = None if boundary is None else boundary["next"]
    return found


async def check_result(deployed: Deployment, reply: httpx.Response, rollout: str, key: str) -> None:
    """The contract's result of ``rollout`` and its tokens under ``key``."""
    assert reply.status_code == 200, reply.text
    expected, tokens = expected_episode(rollout, deployed.task)
    assert reply.json()["result"] == expected
    assert await deployed.tokens(key) == tokens


async def prepared_around_a_held_verify(
    deployed: Deployment,
    group: Any,
    checkpoint_id: str,
    waited: str,
    replayed: str,
    replies: dict[str, httpx.Response],
) -> None:
    """Run one rollout per chain into its held verify, prepare, and let only the waited-for
    verify end while prepare is open: prepare must wait for it and not for the other."""

    async def run(rollout: str, server: str | None) -> None:
        with contextlib.suppress(httpx.TransportError):  # killed with its server (the crash)
            replies[rollout] = await deployed.run(rollout, 0, server)

    group.start_soon(run, replayed, REPLAY_CHAIN[0])
    group.start_soon(run, waited, None)
    await until_verifying(deployed, REPLAY_CHAIN[2])
    await until_verifying(deployed, "resources")
    outcome: list[bool] = []

    async def prepare() -> None:
        outcome.append(
            (await deployed.control.prepare(checkpoint_id, deployed.deadline())).prepared
        )

    group.start_soon(prepare)
    await deployed.until("environment", lambda s: s["phase"] == "preparing", "closes")
    await anyio.sleep(0.5)
    assert outcome == []  # a waited-for verify holds prepare
    release(deployed, waited)
    with anyio.fail_after(WAIT_SECONDS):
        while not outcome:  # noqa: ASYNC110 - the task above
            await anyio.sleep(0.02)
    assert outcome == [True]


async def test_verify_waited_for_and_replayed_side_by_side_without_a_crash(
    supervisor: Supervisor,
) -> None:
    replies: dict[str, httpx.Response] = {}
    async with attached(supervisor, TASK) as deployed:
        before_wait = (await verifies(deployed, "resources"))[1]
        before_replay = (await verifies(deployed, "resources-replay"))[1]
        async with anyio.create_task_group() as group:
            await prepared_around_a_held_verify(deployed, group, "vv-c1", "vw", "vr", replies)
            # The waited-for verify ended inside prepare; the replayable one still runs.
            assert await verifies(deployed, "resources") == (0, before_wait + 1)
            assert await verifies(deployed, "resources-replay") == (1, before_replay)
            directory = deployed.checkpoint_dir("vv-c1")
            scope = [ep("vw"), ep("vr")]
            await deployed.control.commit("vv-c1", deployed.deadline(), directory, scope)
            # The finished episode parked after its last step; the other before its verify.
            assert exported_boundaries(directory) == {"vw": "return", "vr": "verify"}
            assert replies == {}  # the episode that finished during prepare waits for resume
            await deployed.control.resume("vv-c1", deployed.deadline())
            release(deployed, "vr")
        await check_result(deployed, replies["vw"], "vw", "vw")
        await check_result(deployed, replies["vr"], "vr", "vr")
        # Without a crash neither verify runs twice.
        assert (await verifies(deployed, "resources"))[1] == before_wait + 1
        assert (await verifies(deployed, "resources-replay"))[1] == before_replay + 1
        await deployed.control.retire(f"retire-{time.time_ns()}", [ep("vw"), ep("vr")])
        await deployed.control.forget(f"forget-{time.time_ns()}", ["vw", "vr"])


@pytest.mark.timeout(240)  # ten processes killed and started again on a busy 2-core machine
async def test_verify_waited_for_is_not_redone_and_replayed_runs_again_after_a_crash(
    supervisor: Supervisor,
) -> None:
    replies: dict[str, httpx.Response] = {}
    scope = [ep("cw"), ep("cr")]
    async with attached(supervisor, TASK) as deployed:
        async with anyio.create_task_group() as group:
            await prepared_around_a_held_verify(deployed, group, "cv-c1", "cw", "cr", replies)
            directory = deployed.checkpoint_dir("cv-c1")
            await deployed.control.commit("cv-c1", deployed.deadline(), directory, scope)
            assert exported_boundaries(directory) == {"cw": "return", "cr": "verify"}
            await deployed.crash()  # before resume: nothing of attempt 0 was delivered
        assert replies == {}
        assert await verifies(deployed, "resources") == (0, 0)  # fresh processes
        release(deployed, "cr-a1")  # the re-run verify may end at once
        restored = await deployed.control.restore("cv-r1", deployed.deadline(), directory, scope)
        assert restored == ["cr-a1", "cw-a1"]
        await deployed.control.resume("cv-r1", deployed.deadline())
        again: dict[str, httpx.Response] = {}

        async def rerun(rollout: str, server: str | None) -> None:
            again[rollout] = await deployed.run(rollout, 1, server)

        async with anyio.create_task_group() as group:
            group.start_soon(rerun, "cw", None)
            group.start_soon(rerun, "cr", REPLAY_CHAIN[0])
        await check_result(deployed, again["cw"], "cw", "cw-a1")
        await check_result(deployed, again["cr"], "cr", "cr-a1")
        # The episode that finished during prepare returned its recorded reward: no verify.
        assert (await verifies(deployed, "resources"))[1] == 0
        # The replayable verify was cut short by the crash and ran again from its boundary.
        assert (await verifies(deployed, "resources-replay"))[1] == 1
        await deployed.control.retire(f"retire-{time.time_ns()}", [ep("cw", 1), ep("cr", 1)])
        await deployed.control.forget(f"forget-{time.time_ns()}", ["cw", "cr"])


async def test_a_restart_only_rollout_runs_through_a_checkpoint_without_a_crash(
    supervisor: Supervisor,
) -> None:
    async with attached(supervisor, TASK) as deployed:
        replies: dict[str, httpx.Response] = {}

        async def run() -> None:
            replies["ro"] = await deployed.run("ro", 0, "environment-restart")

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            # Held in its (replayable) verify: live until released, holding nothing.
            await until_verifying(deployed, REPLAY_CHAIN[2])
            prepared = await deployed.control.prepare("ro-c1", deployed.deadline())
            # It never holds the checkpoint, and it is reported as a restart, not exported.
            assert prepared.prepared
            assert ep("ro") in prepared.restarts()
            directory = deployed.checkpoint_dir("ro-c1")
            await deployed.control.commit("ro-c1", deployed.deadline(), directory, [])
            assert "ro" not in exported_boundaries(directory)
            await deployed.control.resume("ro-c1", deployed.deadline())
            release(deployed, "ro")
        # With no crash it simply goes on: one result, and no model call made twice.
        await check_result(deployed, replies["ro"], "ro", "ro")
        egress = deployed.egress()
        digests = [e["request_digest"] for e in egress if e["capture_key"] == "ro"]
        assert digests and len(digests) == len(set(digests))
        await deployed.control.retire(f"retire-{time.time_ns()}", [ep("ro")])
        await deployed.control.forget(f"forget-{time.time_ns()}", ["ro"])
