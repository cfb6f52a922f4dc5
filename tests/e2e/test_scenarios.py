"""Process-level scenarios of control-plane §7 against every real server, with real SIGKILL.

One deployment of every role (``tests/e2e/deployment.py``) is started per module; each scenario
uses its own rollout ids, drives ``/run`` and the control plane from the test, and checks results
and token sequences against the contract alone. A scenario that crashes SIGKILLs every process
group and starts fresh ones on the same run root.

Behaviours shown elsewhere by a real-process test that fails without them (not repeated here):

| behaviour | test |
|---|---|
| §7.5 a replacement ``/run`` before resume gets ``admission_closed`` | ``test_server_environment_process.py::test_a_checkpointed_episode_survives_sigkill_and_continues_as_the_next_attempt`` (and here, the second-crash story) |
| §7.6 attempt N refused with ``stale_attempt`` after a restore, per kind | the four ``test_server_*_process.py`` tests; ``test_drill.py`` (stale probes; ``no-restore-fence`` turns ``stale_accepted`` non-zero) |
| §7.9 undelivered model calls re-issued, continuing a cut (a generation cut continued after a crash) | ``test_server_model_process.py::test_a_three_call_chain_then_sigkill_with_a_held_call_and_a_fresh_process_continuing``; ``test_worker_process.py``; ``test_drill.py`` (``cut_continued``, ``ignore-cuts``) |
| §7.9/§7.10 restarts start from input after their crashed attempt is retired (restart-only through a crash) | ``test_drill.py::test_with_restart_only_resources_rollouts_restart_and_still_match_the_baseline`` |
| §7.9 verify replayed after a restore | ``test_server_resources_process.py`` (``verify = replay``; a session continued and verified as N+1) |

Built here: §7.7, §7.8, §7.10 (a retired rollout leaves nothing), §7.11, §7.12 and a held response
delivered at resume with no crash.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from e2e._launch.supervisor import Supervisor
from participants import live_ledger_keys
from protocols import CONTROL_PREFIX, EpisodeId

from .deployment import (
    Deployment,
    attached,
    ep,
    error_code,
    expected_episode,
    start_deployment,
)

pytestmark = [pytest.mark.process, pytest.mark.anyio]
LONG_CALLS = {"activations": 2, "turns": 1, "max_tokens": 96, "seed": 0}
"""Calls long enough that a prepare closes the policy server while one is generating."""
THREE_CALLS = {"activations": 3, "turns": 1, "max_tokens": 64, "seed": 0}


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    started = start_deployment(tmp_path_factory.mktemp("scenarios") / "run")
    try:
        yield started
    finally:
        started.kill_all()


async def finish(deployed: Deployment, rollout: str, attempt: int) -> list[str]:
    """Run one attempt to its result; check result and tokens; its delivered call ids."""
    reply = await deployed.run(rollout, attempt)
    assert reply.status_code == 200, reply.text
    expected, tokens = expected_episode(rollout, deployed.task)
    assert reply.json()["result"] == expected
    key = ep(rollout, attempt).capture_key
    assert await deployed.tokens(key) == tokens
    manifest = await deployed.control.ledger_manifest(key)
    assert manifest is not None
    return [r["model_call_id"] for r in manifest["records"]]


async def tidy(deployed: Deployment, *episodes: EpisodeId) -> None:
    """What a controller does with finished rollouts: retire, then forget."""
    await deployed.control.retire(f"retire-{time.time_ns()}", list(episodes))
    await deployed.control.forget(f"forget-{time.time_ns()}", [e.rollout_id for e in episodes])


async def doomed(deployed: Deployment, rollout: str, attempt: int) -> None:
    """A ``/run`` whose processes are about to be SIGKILLed; a reply that beat the kill is
    dropped like any result delivered after the checkpoint the controller restores."""
    with contextlib.suppress(httpx.TransportError):
        await deployed.run(rollout, attempt)


async def control(deployed: Deployment, role: Any, route: str, **body: Any) -> httpx.Response:
    """One raw control call to one participant."""
    body.setdefault("deadline_ts", deployed.deadline())
    url = deployed.url(role) + f"{CONTROL_PREFIX}/{route}"
    return await deployed.http.post(url, json=body, headers=deployed.auth)


async def test_a_held_response_is_delivered_at_resume_without_a_crash(
    supervisor: Supervisor,
) -> None:
    async with attached(supervisor, LONG_CALLS) as deployed, anyio.create_task_group() as group:
        delivered: list[list[str]] = []

        async def run() -> None:
            delivered.append(await finish(deployed, "held", 0))

        group.start_soon(run)
        await deployed.model_in_flight()
        assert (await deployed.control.prepare("held-c1", deployed.deadline())).prepared
        # The generation ends while the policy server is closed: its response waits at egress.
        await deployed.until("model", lambda s: s["report"]["counts"]["held"] == 1, "held")
        directory = deployed.checkpoint_dir("held-c1")
        await deployed.control.commit("held-c1", deployed.deadline(), directory, [ep("held")])
        assert delivered == []
        await deployed.control.resume("held-c1", deployed.deadline())
    async with attached(supervisor, LONG_CALLS) as deployed:
        egress = [e for e in deployed.egress() if e["capture_key"] == "held"]
        assert [e["model_call_id"] for e in egress] == delivered[0]
        assert [e["held"] for e in egress].count(True) == 1
        await tidy(deployed, ep("held"))


async def test_a_retired_rollout_stops_everywhere_and_leaves_nothing(
    supervisor: Supervisor,
) -> None:
    async with attached(supervisor, LONG_CALLS) as deployed, anyio.create_task_group() as group:
        replies: list[httpx.Response] = []

        async def run() -> None:
            replies.append(await deployed.run("gone", 0))

        group.start_soon(run)
        await deployed.model_in_flight()
        await deployed.control.retire("gone-retire", [ep("gone")])
        with anyio.fail_after(60):
            while not replies:  # noqa: ASYNC110 - the reply comes from another process
                await anyio.sleep(0.02)
        # The episode stopped without a result, and nothing of it runs anywhere any more.
        assert "result" not in replies[0].text, replies[0].text
        for role in ("environment", "agent", "resources", "model"):
            status = await deployed.status(role)
            counts = status["report"]["counts"]
            live = {n: counts.get(n, 0) for n in ("episodes", "sessions", "inflight", "held")}
            assert live == dict.fromkeys(live, 0), (role, counts)
            assert status["retired_rollouts"] == 1, (role, status)
        manifest = await deployed.http.get(
            deployed.url("model") + "/training-token-capture/control/rollouts/gone/manifest",
            headers=deployed.auth,
        )
        assert (manifest.status_code, error_code(manifest)) == (410, "rollout_retired")
        live = live_ledger_keys(deployed.root / "ledger")
        assert not [key for key in live if key.startswith("gone")]  # no live ledger
        again = await deployed.run("gone", 0)
        assert (again.status_code, error_code(again)) == (409, "stale_attempt")
        await deployed.control.forget("gone-forget", ["gone"])
        for role in ("environment", "agent", "resources", "model"):
            assert (await deployed.status(role))["retired_rollouts"] == 0, role


async def test_a_controller_that_dies_prepared_is_outlived_by_the_lease(
    supervisor: Supervisor,
) -> None:
    async with attached(supervisor, LONG_CALLS) as deployed, anyio.create_task_group() as group:
        delivered: list[list[str]] = []

        async def run() -> None:
            delivered.append(await finish(deployed, "lease", 0))

        group.start_soon(run)
        await deployed.model_in_flight()
        # A short deadline, then the controller says nothing more: the lease ends the checkpoint.
        prepared = await deployed.control.prepare("lease-c1", time.time() + 2.0)
        assert prepared.prepared
        for role in ("environment", "agent", "resources", "model"):
            await deployed.until(role, lambda s: s["phase"] == "idle", f"{role} reopens")
        with anyio.fail_after(60):
            while not delivered:  # noqa: ASYNC110 - the reply comes from another process
                await anyio.sleep(0.02)
        late = await control(
            deployed,
            "environment",
            "commit",
            checkpoint_id="lease-c1",
            checkpoint_dir=str(deployed.checkpoint_dir("lease-c1")),
            episode_ids=[ep("lease").model_dump()],
        )
        assert (late.status_code, error_code(late)) == (409, "stale_checkpoint")
        await tidy(deployed, ep("lease"))


async def test_a_commit_with_stop_is_durable_and_the_servers_resume_by_their_lease(
    supervisor: Supervisor,
) -> None:
    async with attached(supervisor, LONG_CALLS) as deployed, anyio.create_task_group() as group:
        delivered: list[list[str]] = []

        async def run() -> None:
            delivered.append(await finish(deployed, "stop", 0))

        group.start_soon(run)
        await deployed.model_in_flight()
        deadline = time.time() + 3.0
        coordinator = await deployed.coordinator()
        assert (await coordinator.prepare("stop-c1", deadline)).prepared
        directory = deployed.checkpoint_dir("stop-c1")
        replies = await coordinator.commit(
            "stop-c1", deadline, str(directory), [ep("stop")], stop=True
        )
        assert all(r.phase == "committed" for r in replies.values())
        # The controller exits here instead of resuming: every manifest is already on disk.
        manifests = sorted(
            p.relative_to(directory).parts[1] for p in directory.rglob("manifest.json")
        )
        assert manifests == ["agent", "environment", "model", "resources"]
        for role in ("environment", "agent", "resources", "model"):
            await deployed.until(role, lambda s: s["phase"] == "idle", f"{role} reopens")
        with anyio.fail_after(60):
            while not delivered:  # noqa: ASYNC110 - the reply comes from another process
                await anyio.sleep(0.02)
        await tidy(deployed, ep("stop"))


@pytest.mark.timeout(300)  # three crashes of five processes each on a busy 2-core machine
async def test_a_second_crash_before_redispatch_and_the_same_checkpoint_restored_twice(
    supervisor: Supervisor,
) -> None:
    """§7.5 to §7.8 in one story: crash with calls in flight, restore as a1, checkpoint again before
    re-dispatch (a1 carried forward), crash, restore that checkpoint as a2, let a2 make calls,
    crash again, restore the same checkpoint again: a2 continues with none of the dead calls."""
    scope0 = [ep("twice", 0)]
    async with attached(supervisor, THREE_CALLS) as deployed:
        async with anyio.create_task_group() as group:
            group.start_soon(doomed, deployed, "twice", 0)
            with anyio.fail_after(60):  # one call delivered, the next one generating
                while not any(e["capture_key"] == "twice" for e in deployed.egress()):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await deployed.model_in_flight()
            committed = await deployed.checkpoint("twice-c1", scope0, resume=False)
            assert committed["environment"] == ["twice"]
            await deployed.crash()
        restored = await deployed.control.restore(
            "twice-r1", deployed.deadline(), deployed.checkpoint_dir("twice-c1"), scope0
        )
        assert restored == ["twice-a1"]
        early = await deployed.run("twice", 1)  # §7.5: only after the resume
        assert (early.status_code, error_code(early)) == (409, "admission_closed")
        await deployed.control.resume("twice-r1", deployed.deadline())
        stale = await deployed.run("twice", 0)  # §7.6: attempt N is fenced
        assert (stale.status_code, error_code(stale)) == (409, "stale_attempt")
        # §7.7: a checkpoint before the replacement ran carries the restored records as a1.
        carried = await deployed.checkpoint("twice-c2", [ep("twice", 1)])
        assert carried["environment"] == ["twice-a1"]
        await deployed.crash()
        assert await deployed.restore("twice-r2", "twice-c2", [ep("twice", 1)]) == ["twice-a2"]
        async with anyio.create_task_group() as group:
            group.start_soon(doomed, deployed, "twice", 2)
            with anyio.fail_after(60):  # §7.8: the dead execution of a2 delivers a call
                while not any(e["capture_key"] == "twice-a2" for e in deployed.egress()):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await deployed.crash()
        dead = {e["model_call_id"] for e in deployed.egress() if e["capture_key"] == "twice-a2"}
        assert await deployed.restore("twice-r3", "twice-c2", [ep("twice", 1)]) == ["twice-a2"]
        lineage = await finish(deployed, "twice", 2)
        assert not dead & set(lineage)
        # No call the restored checkpoint recorded as delivered was executed again.
        egress = deployed.egress()
        recorded = [e for e in egress if e["capture_key"] == "twice"]
        assert recorded and {e["model_call_id"] for e in recorded} <= set(lineage)
        for call in recorded:
            assert [e["request_digest"] for e in egress].count(call["request_digest"]) == 1
        await tidy(deployed, ep("twice", 2))


async def test_the_drills_leftover_counts_a_finished_rollout_not_yet_retired(
    supervisor: Supervisor,
) -> None:
    """The oracle's ``live_ledgers`` reads the policy server's ledger in its layout (SQLite by
    default): a finished rollout's ledger is live until the controller retires it."""
    async with attached(supervisor, THREE_CALLS) as deployed:
        before = (await deployed.control.leftover(deployed.root))["live_ledgers"]
        await finish(deployed, "kept", 0)
        assert (await deployed.control.leftover(deployed.root))["live_ledgers"] == before + 1
        await tidy(deployed, ep("kept"))
        assert (await deployed.control.leftover(deployed.root))["live_ledgers"] == before
