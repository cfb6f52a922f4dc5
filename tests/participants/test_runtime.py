"""The control-plane runtime, rule by rule, in-process under a manual clock."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

import participants._runtime.commit as commit_module
from participants import read_participant_checkpoint
from protocols import (
    CheckpointConflictError,
    CheckpointError,
    CommitReply,
    DeadlineExceededError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    InvalidRequestError,
    Phase,
    PrepareReply,
    RestartInScopeError,
    RetireIncompleteError,
    StaleAttemptError,
    StaleCheckpointError,
)

from .runtime_support import (
    NOW,
    Harness,
    commit_req,
    ep,
    forget_req,
    harness,
    req,
    restore_req,
    retire_req,
)

pytestmark = pytest.mark.anyio


async def _prepared(h: Harness, checkpoint_id: str = "c1") -> PrepareReply:
    reply = await h.plane.prepare(req(checkpoint_id))
    assert reply.phase is Phase.PREPARED
    return reply


async def test_prepare_closes_admission_and_replays_its_stored_result(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        first = await _prepared(h)
        assert not h.fake.admission_open
        second = await h.plane.prepare(req())
        assert second is first
        assert h.fake.close_calls == 1


async def test_prepare_waits_for_a_step_to_finish(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.begin_step("a")
        h.spawn("prepare", lambda: h.plane.prepare(req()))
        await h.settle()
        assert "prepare" not in h.outcomes
        assert h.plane.phase is Phase.PREPARING
        h.fake.end_step("a")
        await h.settle()
        assert h.outcomes["prepare"].phase is Phase.PREPARED


async def test_prepare_past_its_deadline_stays_closed_and_caps_blockers(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        for i in range(150):
            h.fake.start(ep(f"r{i:03d}"))
            h.fake.begin_step(f"r{i:03d}")
        with capture_logs() as logs:
            h.spawn("prepare", lambda: h.plane.prepare(req(deadline=NOW + 10)))
            await h.settle()
            h.clock.advance(10)
            await h.settle()
        reply = h.outcomes["prepare"]
        assert reply.phase is Phase.PREPARING
        assert reply.report.blockers == [f"r{i:03d}" for i in range(100)]
        assert reply.report.blocker_count == 150
        assert not h.fake.admission_open
        assert h.plane.phase is Phase.PREPARING
        assert any(e["event"] == "checkpoint.prepare_not_ready" for e in logs)


async def test_readiness_regressing_before_the_deadline_keeps_the_prepare_waiting(
    tmp_path: Path,
) -> None:
    # The quick check says ready, the report under the lock does not (an episode became a
    # blocker in between): that is no "not ready" reply, since only the deadline ends a prepare.
    async with harness(tmp_path) as h:
        h.fake.ready = lambda: True  # type: ignore[method-assign]
        h.fake.start(ep("a"))
        h.fake.begin_step("a")
        with capture_logs() as logs:
            h.spawn("prepare", lambda: h.plane.prepare(req(deadline=NOW + 10)))
            await h.settle()
            assert "prepare" not in h.outcomes
            assert h.plane.phase is Phase.PREPARING
            h.fake.end_step("a")  # the change that makes it ready again
            await h.settle()
        assert h.outcomes["prepare"].phase is Phase.PREPARED
        assert not any(e["event"] == "checkpoint.prepare_not_ready" for e in logs)


async def test_readiness_that_stays_regressed_ends_the_prepare_at_its_deadline(
    tmp_path: Path,
) -> None:
    async with harness(tmp_path) as h:
        h.fake.ready = lambda: True  # type: ignore[method-assign]
        h.fake.start(ep("a"))
        h.fake.begin_step("a")
        h.spawn("prepare", lambda: h.plane.prepare(req(deadline=NOW + 10)))
        await h.settle()
        h.clock.advance(5)  # a poll past the regression: still not ready, still waiting
        await h.settle()
        assert "prepare" not in h.outcomes
        h.clock.advance(5)
        await h.settle()
        reply = h.outcomes["prepare"]
        assert reply.phase is Phase.PREPARING
        assert reply.report.blockers == ["a"]


async def test_resume_interrupts_a_waiting_prepare_then_the_id_is_stale(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.begin_step("a")
        h.spawn("prepare", lambda: h.plane.prepare(req()))
        await h.settle()
        resumed = await h.plane.resume(req())
        assert (resumed.phase, resumed.idempotent) == (Phase.IDLE, False)
        await h.settle()
        assert h.outcomes["prepare"].phase is Phase.IDLE
        assert h.fake.admission_open
        with pytest.raises(StaleCheckpointError):
            await h.plane.prepare(req())
        again = await h.plane.resume(req())
        assert again.idempotent is True


async def test_resume_before_any_prepare_blocks_a_late_prepare(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        assert (await h.plane.resume(req("late"))).idempotent is True
        with pytest.raises(StaleCheckpointError):
            await h.plane.prepare(req("late"))
        assert h.fake.admission_open


async def test_a_failing_close_reopens_admission(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.fail_close = RuntimeError("cannot close")
        with pytest.raises(RuntimeError):
            await h.plane.prepare(req())
        assert h.fake.admission_open
        assert (h.plane.phase, h.plane.checkpoint_id) == (Phase.IDLE, None)
        h.fake.fail_close = None
        assert (await h.plane.prepare(req())).phase is Phase.PREPARED


async def test_admission_order_stale_then_conflict_then_phase(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await h.plane.resume(req("old"))
        await _prepared(h, "c1")
        with pytest.raises(StaleCheckpointError):
            await h.plane.prepare(req("old"))
        with pytest.raises(CheckpointConflictError):
            await h.plane.prepare(req("other"))
        with pytest.raises(InvalidPhaseError):
            await h.plane.restore(restore_req(h.directory(), [], checkpoint_id="c1"))


async def test_commit_requires_prepared(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        with pytest.raises(InvalidPhaseError):
            await h.plane.commit(commit_req(h.directory(), []))
        assert not Path(h.directory()).exists()


async def test_commit_writes_the_first_export_and_a_retry_returns_it(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.start(ep("b", 2))
        await _prepared(h)
        scope = [ep("a"), ep("b", 2)]
        first = await h.plane.commit(commit_req(h.directory(), scope))
        assert first.episode_ids == ["a", "b-a2"]
        assert h.plane.phase is Phase.COMMITTED
        again = await h.plane.commit(commit_req(h.directory(), list(reversed(scope))))
        assert again == first
        assert h.fake.export_calls == 1
        share = read_participant_checkpoint(
            Path(h.directory()) / "gym" / "environment" / "fake",
            kind="environment",
            instance="fake",
        )
        assert share.records == h.fake.exports[0]
        assert share.manifest == first.manifest.model_dump()
        # The records and their bytes are counted once: the retry wrote nothing.
        records_file = (
            Path(h.directory()) / "gym" / "environment" / "fake" / first.manifest.records_file
        )
        registry = h.plane.telemetry.registry
        moved = {"operation": "commit"}
        assert registry.get_sample_value("midflight_checkpoint_records_total", moved) == 2
        assert (
            registry.get_sample_value("midflight_checkpoint_bytes_total", moved)
            == records_file.stat().st_size
        )


@pytest.mark.parametrize("change", ["directory", "scope"])
async def test_a_commit_retry_with_other_arguments_conflicts(tmp_path: Path, change: str) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.start(ep("b"))
        await _prepared(h)
        await h.plane.commit(commit_req(h.directory(), [ep("a")]))
        other = (
            commit_req(h.directory("elsewhere"), [ep("a")])
            if change == "directory"
            else commit_req(h.directory(), [ep("a"), ep("b")])
        )
        with pytest.raises(CheckpointConflictError):
            await h.plane.commit(other)


async def test_a_commit_refused_after_readiness_regressed_writes_nothing(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        h.fake.begin_step("a")  # e.g. a held response was delivered out of order
        with pytest.raises(InvalidPhaseError, match="no longer ready"):
            await h.plane.commit(commit_req(h.directory(), [ep("a")]))
        assert not Path(h.directory()).exists()
        assert h.fake.export_calls == 0


async def test_a_scope_naming_a_restart_is_refused(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.restarts.add("a")
        await _prepared(h)
        with pytest.raises(RestartInScopeError):
            await h.plane.commit(commit_req(h.directory(), [ep("a")]))


async def test_a_relative_checkpoint_dir_is_invalid(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        await _prepared(h)
        with pytest.raises(InvalidRequestError, match="absolute"):
            await h.plane.commit(commit_req("relative/dir", []))


async def test_a_deadline_far_ahead_is_accepted_and_capped_at_the_horizon(tmp_path: Path) -> None:
    # The reference accepts any finite deadline (D225); the work and the lease stop at the
    # horizon (3600 s by default) plus the grace (600 s).
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        h.fake.begin_step("a")
        h.spawn("prepare", lambda: h.plane.prepare(req(deadline=NOW + 86_400 * 365)))
        await h.settle()
        assert h.plane.lease_expires_at == NOW + 3600 + 600
        h.clock.advance(3599)
        await h.settle()
        assert "prepare" not in h.outcomes  # still waiting for the episode to park
        h.clock.advance(1)
        await h.settle()
        assert h.outcomes["prepare"].phase is Phase.PREPARING  # not ready at the horizon
        renewed = await h.plane.renew(req(deadline=NOW + 1e12))
        assert renewed.lease_expires_at == NOW + 3600 + 3600 + 600
        await h.plane.resume(req(deadline=NOW + 1e12))
        assert h.fake.admission_open and h.plane.phase is Phase.IDLE
        await h.plane.retire(retire_req([ep("a")]).model_copy(update={"deadline_ts": 1e15}))
        assert (await h.plane.forget(forget_req(["a"]))).forgotten == ["a"]


async def test_an_export_outliving_the_deadline_is_awaited_by_the_retry(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        gate = h.fake.export_gate = anyio.Event()
        h.spawn(
            "first", lambda: h.plane.commit(commit_req(h.directory(), [ep("a")], deadline=NOW + 5))
        )
        await h.settle()
        h.clock.advance(5)
        await h.settle()
        assert isinstance(h.outcomes["first"], DeadlineExceededError)
        h.spawn(
            "retry", lambda: h.plane.commit(commit_req(h.directory(), [ep("a")], deadline=NOW + 60))
        )
        await h.settle()
        gate.set()
        await h.settle()
        assert isinstance(h.outcomes["retry"], CommitReply)
        assert h.fake.export_calls == 1


async def test_resume_during_an_unpublished_commit_means_no_manifest(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        gate = h.fake.export_gate = anyio.Event()
        h.spawn("commit", lambda: h.plane.commit(commit_req(h.directory(), [ep("a")])))
        await h.settle()
        await h.plane.resume(req())
        gate.set()
        await h.settle()
        assert isinstance(h.outcomes["commit"], Exception)
        assert not list(Path(tmp_path).rglob("manifest.json"))
        assert h.fake.admission_open


async def test_resume_stops_a_write_in_progress_before_it_publishes(tmp_path: Path) -> None:
    in_write = threading.Event()
    release = threading.Event()

    def on_write_step(name: str) -> None:
        if name == "records_synced":
            in_write.set()
            release.wait(timeout=30)

    async with harness(tmp_path, on_write_step=on_write_step) as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        h.spawn("commit", lambda: h.plane.commit(commit_req(h.directory(), [ep("a")])))
        await anyio.to_thread.run_sync(in_write.wait, 30)
        await h.plane.resume(req())
        release.set()
        await h.settle()
        assert isinstance(h.outcomes["commit"], InvalidCheckpointStateError)
        assert not list(Path(tmp_path).rglob("manifest.json"))


async def test_lease_expiry_resumes_and_the_id_becomes_stale(tmp_path: Path) -> None:
    async with harness(tmp_path, lease_grace_seconds=30) as h:
        await _prepared(h)
        assert h.plane.lease_expires_at == NOW + 60 + 30
        with capture_logs() as logs:
            h.clock.advance(91)
            await h.settle()
        assert h.plane.phase is Phase.IDLE and h.fake.admission_open
        assert any(e["event"] == "checkpoint.lease_expired" for e in logs)
        with pytest.raises(StaleCheckpointError):
            await h.plane.commit(commit_req(h.directory(), []))


async def test_renew_keeps_a_slow_controller_in_charge(tmp_path: Path) -> None:
    async with harness(tmp_path, lease_grace_seconds=30) as h:
        await _prepared(h)
        h.clock.advance(80)
        renewed = await h.plane.renew(req(deadline=NOW + 200))
        assert renewed.lease_expires_at == NOW + 230
        h.clock.advance(100)  # past the first lease
        await h.settle()
        assert h.plane.phase is Phase.PREPARED
        reply = await h.plane.commit(commit_req(h.directory(), [], deadline=NOW + 200))
        assert reply.phase is Phase.COMMITTED


async def test_renew_of_an_inactive_id_is_refused(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        with pytest.raises(InvalidPhaseError):
            await h.plane.renew(req())


async def test_resume_fails_while_restored_state_is_still_being_deleted(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        # A restored-but-unstarted attempt left out of the next commit's scope gets deleted.
        h.fake.restored["x-a1"] = {"episode_id": {"rollout_id": "x", "attempt": 1}, "step": 1}
        await _prepared(h)
        gate = h.fake.delete_gate = anyio.Event()
        h.spawn("commit", lambda: h.plane.commit(commit_req(h.directory(), [], deadline=NOW + 5)))
        await h.settle()
        h.clock.advance(5)
        await h.settle()
        assert isinstance(h.outcomes["commit"], DeadlineExceededError)
        with pytest.raises(DeadlineExceededError, match="still being deleted"):
            await h.plane.resume(req(deadline=NOW + 5))  # the clock is already there
        assert not h.fake.admission_open
        gate.set()
        await h.settle()
        assert (await h.plane.resume(req(deadline=NOW + 60))).idempotent is False
        assert h.fake.admission_open and "x-a1" not in h.fake.restored


async def test_a_null_scope_deletes_no_restored_state(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.restored["x-a1"] = {"episode_id": {"rollout_id": "x", "attempt": 1}, "step": 1}
        await _prepared(h)
        reply = await h.plane.commit(commit_req(h.directory(), None))
        assert reply.episode_ids == ["x-a1"]
        assert "x-a1" in h.fake.restored


async def _committed_checkpoint(root: Path) -> str:
    """A published checkpoint of episodes a (step 3) and b-a1 (step 1)."""
    async with harness(root) as h:
        h.fake.start(ep("a"))
        h.fake.start(ep("b", 1))
        for _ in range(3):
            h.fake.begin_step("a")
            h.fake.end_step("a")
        h.fake.begin_step("b-a1")
        h.fake.end_step("b-a1")
        await _prepared(h)
        await h.plane.commit(commit_req(h.directory(), [ep("a"), ep("b", 1)]))
        return h.directory()


async def test_restore_installs_next_attempts_and_fences_the_checkpointed_ones(
    tmp_path: Path,
) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        reply = await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
        assert reply.phase is Phase.RESTORED
        assert reply.restored == ["a-a1", "b-a2"]
        assert reply.source_checkpoint_id == "c1"
        assert not h.fake.admission_open
        assert await h.plane.restore(restore_req(directory, [ep("b", 1), ep("a")])) == reply
        # Read once: the replayed restore read nothing again.
        records = next((Path(directory) / "gym" / "environment" / "fake").glob("records-*"))
        registry, moved = h.plane.telemetry.registry, {"operation": "restore"}
        assert registry.get_sample_value("midflight_checkpoint_records_total", moved) == 2
        assert registry.get_sample_value("midflight_checkpoint_bytes_total", moved) == (
            records.stat().st_size
        )
        await h.plane.resume(req("r1"))
        with pytest.raises(StaleAttemptError):
            h.fake.start(ep("a"))
        with pytest.raises(StaleAttemptError):
            h.fake.start(ep("b", 1))
        h.fake.start(ep("a", 1))
        assert h.fake.episodes["a-a1"].step == 3
        status = await h.plane.status()
        # Fences, not retire marks: a controller forgetting only what it retired sees 0 (D223).
        assert status.retired_rollouts == 0
        assert status.model_extra is not None and status.model_extra["restore_fences"] == 2


async def test_a_restore_fence_ends_with_forget_or_a_retire_that_reaches_it(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        # "z" is in the scope but not in the checkpoint: it is fenced all the same (D18), and
        # its fence ends the same ways (D224).
        await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1), ep("z", 2)]))
        await h.plane.resume(req("r1"))
        assert h.plane.marks.restore_fences() == {"a": 0, "b": 1, "z": 2}
        h.fake.start(ep("a", 1))  # the restored attempt runs...
        await h.plane.retire(retire_req([ep("a", 1)]))  # ...and the controller retires it
        assert (h.plane.marks.retire_marks(), h.plane.marks.restore_fences()) == (
            {"a": 1},
            {"b": 1, "z": 2},
        )
        await h.plane.retire(retire_req([ep("b", 0)]))  # a mark below the fence leaves it
        with pytest.raises(StaleAttemptError, match="fenced by a restore"):
            h.fake.start(ep("b", 1))
        await h.plane.forget(forget_req(["a", "b"]))
        status = await h.plane.status()
        assert status.retired_rollouts == 0
        assert status.model_extra is not None and status.model_extra["restore_fences"] == 1
        with pytest.raises(StaleAttemptError, match="fenced by a restore"):
            h.fake.start(ep("z", 2))  # late work of a fenced attempt is still refused
        await h.plane.forget(forget_req(["z"]))
        assert h.plane.marks.snapshot() == {}
        h.fake.start(ep("z", 0))
        h.fake.start(ep("b", 0))


async def test_restore_scope_filters_records(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        reply = await h.plane.restore(restore_req(directory, [ep("a")]))
        assert reply.restored == ["a-a1"]
        assert sorted(h.fake.restored) == ["a-a1"]


async def test_restore_is_refused_on_a_process_that_served(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        h.fake.start(ep("z"))
        with pytest.raises(CheckpointError, match="fresh process"):
            await h.plane.restore(restore_req(directory, [ep("a")]))
        assert h.fake.admission_open and h.plane.phase is Phase.IDLE


async def test_corrupt_records_install_nothing(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    records = next(Path(directory).rglob("records-*.jsonl"))
    records.write_bytes(records.read_bytes().replace(b'"step": 3', b'"step": 4'))
    async with harness(tmp_path) as h:
        with pytest.raises(InvalidCheckpointStateError, match="digest"):
            await h.plane.restore(restore_req(directory, [ep("a")]))
        assert h.fake.installed == [] and h.fake.admission_open
        assert h.plane.phase is Phase.IDLE


async def test_an_invalid_record_leaves_the_participant_idle_and_open(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        h.fake.fail_install = CheckpointError("record b-a1 is not valid")
        with pytest.raises(CheckpointError):
            await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
        assert h.fake.restored == {} and h.fake.admission_open
        assert (h.plane.phase, h.plane.checkpoint_id) == (Phase.IDLE, None)
        assert h.plane.marks.snapshot() == {}


async def test_retire_and_forget_are_refused_while_a_checkpoint_is_open(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        for checkpoint_id in ("c1", "retire"):
            with pytest.raises(InvalidPhaseError, match="resume first"):
                await h.plane.retire(retire_req([ep("a")], checkpoint_id))
            with pytest.raises(InvalidPhaseError):
                await h.plane.forget(forget_req(["a"], checkpoint_id))
        assert h.plane.marks.snapshot() == {}
        assert "a" in h.fake.episodes


async def test_marks_only_rise_and_forget_removes_them(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a", 0))
        h.fake.start(ep("b", 0))
        reply = await h.plane.retire(retire_req([ep("a", 3), ep("b", 0)]))
        assert reply.retired == ["a-a3", "b"]
        assert h.fake.episodes == {}
        await h.plane.retire(retire_req([ep("a", 1)]))
        assert h.plane.marks.snapshot() == {"a": 3, "b": 0}
        with pytest.raises(StaleAttemptError):
            h.fake.start(ep("a", 2))
        h.fake.start(ep("a", 4))
        assert (await h.plane.forget(forget_req(["b", "a", "b"]))).forgotten == ["a", "b"]
        assert h.plane.marks.snapshot() == {}
        h.fake.start(ep("a", 1))


async def test_retire_in_a_restore_needs_the_restore_id(tmp_path: Path) -> None:
    directory = await _committed_checkpoint(tmp_path)
    async with harness(tmp_path) as h:
        await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
        with pytest.raises(CheckpointConflictError):
            await h.plane.retire(retire_req([ep("a", 1)], "retire"))
        await h.plane.retire(retire_req([ep("a", 1)], "r1"))
        assert sorted(h.fake.restored) == ["b-a2"]


async def test_operations_are_logged_and_counted(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        with capture_logs() as logs:
            await _prepared(h)
            with pytest.raises(CheckpointConflictError):
                await h.plane.prepare(req("other"))
        events = [(e["event"], e["outcome"], e.get("code")) for e in logs]
        assert events == [
            ("checkpoint.prepare", "ok", None),
            ("checkpoint.prepare", "refused", "checkpoint_conflict"),
        ]
        assert logs[0]["checkpoint_id"] == "c1"
        registry = h.plane.telemetry.registry
        assert (
            registry.get_sample_value(
                "midflight_checkpoint_operations_total", {"operation": "prepare", "outcome": "ok"}
            )
            == 1
        )
        assert (
            registry.get_sample_value(
                "midflight_checkpoint_refusals_total", {"code": "checkpoint_conflict"}
            )
            == 1
        )
        assert registry.get_sample_value("midflight_checkpoint_phase", {"phase": "prepared"}) == 1


async def test_a_participant_refusal_keeps_its_code(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def refuse(rollout_ids: object) -> None:
            raise RetireIncompleteError("sessions of a are not freed yet")

        h.fake.forget = refuse  # type: ignore[method-assign]
        await h.plane.retire(retire_req([ep("a")]))
        with pytest.raises(RetireIncompleteError):
            await h.plane.forget(forget_req(["a"]))
        assert h.plane.marks.snapshot() == {"a": 0}, "a refused forget changes nothing"


@pytest.mark.parametrize(
    ("episode_id", "refusal"),
    [
        ({"rollout_id": "zz", "attempt": 0}, "outside the scope"),
        ({"rollout_id": "a", "attempt": 1}, "outside the scope"),
        ({"rollout_id": "a", "attempt": 0, "extra": 1}, "no valid episode_id"),
        ({"rollout_id": "a", "attempt": True}, "no valid episode_id"),
        ("a", "no valid episode_id"),
        (None, "no valid episode_id"),
    ],
)
async def test_a_commit_refuses_an_export_outside_its_scope_or_malformed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, episode_id: object, refusal: str
) -> None:
    async with harness(tmp_path) as h:
        h.fake.start(ep("a"))
        await _prepared(h)

        async def export(episode_ids: object) -> list[dict[str, object]]:
            return [{"episode_id": {"rollout_id": "a", "attempt": 0}}, {"episode_id": episode_id}]

        monkeypatch.setattr(h.fake, "export", export)
        with pytest.raises(InvalidCheckpointStateError, match=refusal):
            await h.plane.commit(commit_req(h.directory(), [ep("a")]))


async def test_a_commit_validates_no_scoped_record_s_episode_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D425: an exported record naming a scoped attempt as a plain object is that attempt."""
    validated: list[object] = []
    real = commit_module.record_episode

    def counting(record: object, index: int) -> object:
        validated.append(record)
        return real(record, index)

    monkeypatch.setattr(commit_module, "record_episode", counting)
    async with harness(tmp_path) as h:
        for name in ("a", "b", "c"):
            h.fake.start(ep(name))
        await _prepared(h)
        reply = await h.plane.commit(commit_req(h.directory(), [ep("a"), ep("b"), ep("c")]))
        assert reply.episode_ids == ["a", "b", "c"]
        assert validated == []
    async with harness(tmp_path / "unscoped") as h:
        h.fake.start(ep("a"))
        await _prepared(h)
        await h.plane.commit(commit_req(h.directory(), None))
        assert len(validated) == 1  # without a scope every record is validated
