"""The reference servers as a strict reference controller sees them (D226).

The flow is the reference controller's (control-plane §3.4 and §3.5, policy §2.14): a checkpoint
of a rollout with one delivered call and one generating, a crash, a restore into fresh servers,
the rollout run to its end as attempt 1, its manifest read and its ledger retired, an abandoned
attempt retired and forgotten. The servers are the five reference apps in one process
(``InProcessCluster``), reached through ``httpx.ASGITransport``; every reply is read with the
strict models of :mod:`tests.e2e.reference_client`, written from the reference documents.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from e2e._bench.common import InProcessCluster, Workload
from e2e._drill.tokens_of import token_sequence

from .deployment import expected_episode
from .reference_client import (
    LEDGER,
    PREPARE_ORDER,
    RETIRE_ORDER,
    CallRecord,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    EpisodeId,
    ForgetReply,
    ForgetRequest,
    ModelCommitReply,
    PrepareReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    RolloutRemoval,
    controller,
    deadline,
)

pytestmark = pytest.mark.anyio

WORKLOAD = Workload(activations=2, turns=1, max_tokens=48, token_delay_ms=20.0)
"""Two model calls; the second generates for about a second, so a checkpoint cuts it."""
FAST = Workload(activations=2, turns=1, max_tokens=48, token_delay_ms=0.0)
"""The same task after the crash, generated without delay."""


def run_body(rollout: str, attempt: int) -> dict[str, object]:
    return {
        "episode_id": {"rollout_id": rollout, "attempt": attempt},
        "task": {
            "task_id": {"taskset": "counter", "task_id": rollout},
            "task_input": FAST.task_input(),
        },
    }


async def checkpoint_with_a_call_delivered_and_one_generating(root: Path, directory: Path) -> None:
    """The first incarnation: one rollout, checkpointed mid-way, then dropped (the crash)."""
    cluster = InProcessCluster(root, WORKLOAD)
    async with cluster.running(), controller(cluster) as ref, anyio.create_task_group() as group:
        group.start_soon(cluster.run, "r0")

        async def one_delivered_one_generating() -> None:
            # The servers' state signals nothing a client could wait on: poll it.
            while True:
                manifest = await ref.manifest("r0")
                if len(manifest.records) == 1 and cluster.generations_running() == 1:
                    return
                await anyio.sleep(0.02)

        with anyio.fail_after(60):  # bounds the wait; asserts nothing about speed
            await one_delivered_one_generating()
        for status in (await ref.statuses()).values():
            assert status.phase == "idle" and status.retired_rollouts == 0
        for role in PREPARE_ORDER:
            body = CheckpointRequest(checkpoint_id="c1", deadline_ts=deadline())
            prepared = await ref.control(role, "prepare", body, PrepareReply)
            assert prepared.phase == "prepared" and prepared.report.ready, (role, prepared)
        scope = [EpisodeId(rollout_id="r0", attempt=0)]
        for role in PREPARE_ORDER:
            body = CommitRequest(
                checkpoint_id="c1",
                deadline_ts=deadline(),
                checkpoint_dir=str(directory),
                episode_ids=scope,
            )
            model = ModelCommitReply if role == "model" else CommitReply
            committed = await ref.control(role, "commit", body, model)
            assert committed.manifest.checkpoint_id == "c1"
            if role in ("environment", "model"):
                assert committed.episode_ids == ["r0"], (role, committed)
        await ref.resume("c1")
        group.cancel_scope.cancel()  # the crash: nothing of this incarnation survives


async def test_a_strict_reference_controller_through_checkpoint_crash_restore_and_retire(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    directory = root / "checkpoints" / "c1"
    await checkpoint_with_a_call_delivered_and_one_generating(root, directory)

    cluster = InProcessCluster(root, FAST)  # fresh servers on the same run root
    async with cluster.running(), controller(cluster) as ref:
        scope = [EpisodeId(rollout_id="r0", attempt=0)]
        for role in PREPARE_ORDER:
            body = RestoreRequest(
                checkpoint_id="restore-1",
                deadline_ts=deadline(),
                checkpoint_dir=str(directory),
                episode_ids=scope,
            )
            restored = await ref.control(role, "restore", body, RestoreReply)
            assert restored.source_checkpoint_id == "c1"
            assert restored.restored == ["r0-a1"], (role, restored)
        await ref.resume("restore-1")

        # The fence: late work of the crashed attempt is refused.
        stale = await ref.refused("environment", "POST", "/run", json=run_body("r0", 0))
        assert stale.code == "stale_attempt"

        reply = await cluster.run("r0", 1)
        expected_result, expected_tokens = expected_episode("r0", FAST.task_input())
        assert reply["result"] == expected_result, reply

        # The restored attempt's manifest parses with the reference's CallRecord (item 2), and
        # the drill's token oracle rebuilds its tokens from it and the staging store.
        manifest = await ref.manifest("r0-a1")
        assert manifest.rollout_id == "r0-a1" and manifest.failures == []
        carried, continued = manifest.records
        assert carried.staging_key.startswith("r0/")  # staged by attempt 0, carried over
        assert continued.parent_call_id == carried.model_call_id
        records = [record.model_dump() for record in manifest.records]
        assert token_sequence(records, root / "staging") == expected_tokens

        # The reference flow: read the manifest, retire the finished attempt's ledger, delete
        # at the end of the run.
        retired = await ref.ledger("retire", ["r0-a1"])
        assert retired == RolloutRemoval(removed=["r0-a1"], absent=[])
        gone = await ref.refused("model", "GET", f"{LEDGER}/rollouts/r0-a1/manifest")
        assert gone.code == "rollout_retired"
        deleted = await ref.ledger("delete", ["r0", "r0-a1"])
        assert sorted(deleted.removed + deleted.absent) == ["r0", "r0-a1"]

        # An abandoned attempt: retired everywhere in RETIRE_ORDER, then forgotten, by a
        # controller configured with a long timeout (any finite deadline is accepted: item 4).
        abandoned = [EpisodeId(rollout_id="gone", attempt=0)]
        for group in RETIRE_ORDER:
            for role in group:
                body = RetireRequest(
                    checkpoint_id="retire", deadline_ts=deadline(7200), episode_ids=abandoned
                )
                assert (await ref.control(role, "retire", body, RetireReply)).retired == ["gone"]
        for status in (await ref.statuses()).values():
            assert status.retired_rollouts == 1, status
        for group in RETIRE_ORDER:
            for role in group:
                body = ForgetRequest(
                    checkpoint_id="forget", deadline_ts=deadline(7200), rollout_ids=["gone"]
                )
                assert (await ref.control(role, "forget", body, ForgetReply)).forgotten == ["gone"]

        # The reference's end-of-run invariant (item 3): no retire mark is left after forget,
        # while the restore's fence, counted apart, still refuses the crashed attempt.
        for role, status in (await ref.statuses()).items():
            assert status.phase == "idle" and status.retired_rollouts == 0, (role, status)
            assert status.model_extra is not None
            assert status.model_extra["restore_fences"] == 1, (role, status)
        stale = await ref.refused("environment", "POST", "/run", json=run_body("r0", 0))
        assert stale.code == "stale_attempt"


async def test_an_extra_or_missing_field_fails_the_strict_models() -> None:
    # The strict models are what make the test above fail on a wire change: check they would.
    record = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "model_call_id": "c",
        "parent_call_id": None,
        "staging_key": "r/c",
        "weight_version": 0,
        "prev_len": 0,
        "delta_len": 1,
        "cum_len": 1,
        "digest": "a",
        "extras_digest": "b",
        "mode": "text",
        "admitted_at": None,
        "chain_hash": "c",
        "cumulative_hash": "d",
        "response_id": "e",
        "output_fingerprint": None,
        "continuation_fingerprint": None,
        "fingerprint_version": 1,
    }
    CallRecord.model_validate(record)
    with pytest.raises(ValueError):
        CallRecord.model_validate({**record, "capture_key": "r"})
    with pytest.raises(ValueError):
        CallRecord.model_validate({k: v for k, v in record.items() if k != "response_id"})
    with pytest.raises(ValueError):
        ResumeReply.model_validate({"phase": "idle"})
