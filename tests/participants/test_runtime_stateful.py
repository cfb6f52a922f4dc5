"""Random sequences of every control operation, with the runtime's invariants after each step.

Repeats, out-of-order calls, expired leases (a manual clock) and a participant whose export
changes on every call. After every step:

1. no checkpoint open and no write running ⇒ admission open;
2. every manifest on disk verifies and holds the first export of its checkpoint;
3. a checkpoint resumed before publication never gets a manifest;
4. retire marks never fall, except through forget.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from participants import ControlPlane, ControlSettings, ManualClock, read_participant_checkpoint
from protocols import (
    CheckpointRequest,
    CommitRequest,
    EpisodeId,
    ForgetRequest,
    MidflightError,
    Phase,
    RestoreRequest,
    RetireRequest,
)

from .fakes import FakeParticipant
from .runtime_support import NOW

SOAK = os.environ.get("MIDFLIGHT_SOAK") == "1"
IDS = st.sampled_from(["c1", "c2", "c3", "c4"])
ROLLOUTS = st.sampled_from(["a", "b", "c"])
ATTEMPTS = st.integers(min_value=0, max_value=2)
DEADLINES = st.sampled_from([-5.0, 5.0, 60.0])


class TrackingFake(FakeParticipant):
    """Remembers which checkpoint each export belonged to."""

    def __init__(self) -> None:
        super().__init__()
        self.current_checkpoint: str | None = None
        self.first_export: dict[str, list[Any]] = {}

    async def close_admission(self, request: CheckpointRequest) -> None:
        await super().close_admission(request)
        self.current_checkpoint = request.checkpoint_id

    async def export(self, episode_ids: Any) -> list[Any]:
        records = await super().export(episode_ids)
        if self.current_checkpoint is not None:
            self.first_export.setdefault(self.current_checkpoint, records)
        return records


class ControlPlaneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="midflight-stateful-"))
        self.clock = ManualClock(NOW)
        self.fake = TrackingFake()
        self.write_gate = threading.Event()
        self.write_gate.set()
        self.plane = ControlPlane(
            self.fake,
            clock=self.clock,
            settings=ControlSettings(lease_grace_seconds=30),
            on_write_step=self._write_step,
        )
        self._portal_cm = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self._running = self.portal.wrap_async_context_manager(self.plane.running())
        self._running.__enter__()
        self.pending: list[Future[Any]] = []
        self.marks: dict[str, int] = {}
        self.unpublished_when_resumed: dict[str, set[Path]] = {}

    def _write_step(self, name: str) -> None:
        if name == "records_synced":  # in the writer's thread, before publication
            self.write_gate.wait(timeout=30)

    def teardown(self) -> None:
        self.write_gate.set()
        if self.fake.export_gate is not None:
            self.portal.call(self._release_gate)
        for future in self.pending:
            future.cancel()
        self._running.__exit__(None, None, None)
        self._portal_cm.__exit__(None, None, None)
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return self.clock.time()

    def _launch(self, coroutine_function: Any, *args: Any) -> None:
        self.pending.append(self.portal.start_task_soon(coroutine_function, *args))

    def _settle(self) -> None:
        async def settle() -> None:
            for _ in range(2):
                await anyio.wait_all_tasks_blocked()
                await anyio.sleep(0.002)

        self.portal.call(settle)
        still = []
        for future in self.pending:
            if future.done():
                error = future.exception()
                assert error is None or isinstance(error, MidflightError), repr(error)
            else:
                still.append(future)
        self.pending = still

    def _directory(self, checkpoint_id: str, variant: int) -> Path:
        return self.root / checkpoint_id / f"v{variant}"

    # ------------------------------------------------------------------ data plane
    @rule(rollout=ROLLOUTS, attempt=ATTEMPTS)
    def start_episode(self, rollout: str, attempt: int) -> None:
        key = EpisodeId(rollout_id=rollout, attempt=attempt).capture_key
        if key in self.fake.episodes:
            return

        async def start() -> None:
            with contextlib.suppress(MidflightError):
                self.fake.start(EpisodeId(rollout_id=rollout, attempt=attempt))

        self.portal.call(start)
        self._settle()

    @rule(rollout=ROLLOUTS, attempt=ATTEMPTS, finish=st.booleans())
    def step(self, rollout: str, attempt: int, finish: bool) -> None:
        key = EpisodeId(rollout_id=rollout, attempt=attempt).capture_key

        async def act() -> None:
            if key in self.fake.episodes:
                (self.fake.end_step if finish else self.fake.begin_step)(key)

        self.portal.call(act)
        self._settle()

    # ------------------------------------------------------------------ control plane
    @rule(checkpoint_id=IDS, deadline=DEADLINES)
    def prepare(self, checkpoint_id: str, deadline: float) -> None:
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=self._now() + deadline)
        self._launch(self.plane.prepare, request)
        self._settle()

    @rule(checkpoint_id=IDS, variant=st.integers(0, 1), scope=st.sampled_from(["all", "a", "none"]))
    def commit(self, checkpoint_id: str, variant: int, scope: str) -> None:
        episodes = [EpisodeId.from_capture_key(k) for k in sorted(self.fake.episodes)]
        chosen = {
            "all": episodes,
            "a": [e for e in episodes if e.rollout_id == "a"],
            "none": None,
        }[scope]
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=self._now() + 60,
            checkpoint_dir=str(self._directory(checkpoint_id, variant)),
            episode_ids=chosen,
        )
        self._launch(self.plane.commit, request)
        self._settle()

    @rule(checkpoint_id=IDS)
    def resume(self, checkpoint_id: str) -> None:
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=self._now() + 60)
        self._launch(self.plane.resume, request)
        self._settle()

    @rule(checkpoint_id=IDS)
    def renew(self, checkpoint_id: str) -> None:
        request = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=self._now() + 60)
        self._launch(self.plane.renew, request)
        self._settle()

    @rule(checkpoint_id=IDS)
    def restore(self, checkpoint_id: str) -> None:
        request = RestoreRequest(
            checkpoint_id=f"r-{checkpoint_id}",
            deadline_ts=self._now() + 60,
            checkpoint_dir=str(self._directory(checkpoint_id, 0)),
            episode_ids=[EpisodeId(rollout_id="a")],
        )
        self._launch(self.plane.restore, request)
        self._settle()

    @rule(rollout=ROLLOUTS, attempt=ATTEMPTS)
    def retire(self, rollout: str, attempt: int) -> None:
        request = RetireRequest(
            checkpoint_id="retire",
            deadline_ts=self._now() + 60,
            episode_ids=[EpisodeId(rollout_id=rollout, attempt=attempt)],
        )
        self._launch(self.plane.retire, request)
        self._settle()

    @rule(rollout=ROLLOUTS)
    def forget(self, rollout: str) -> None:
        request = ForgetRequest(
            checkpoint_id="forget", deadline_ts=self._now() + 60, rollout_ids=[rollout]
        )
        future = self.portal.start_task_soon(self.plane.forget, request)
        self._settle()
        if future.done() and future.exception() is None:
            self.marks.pop(rollout, None)
        else:
            self.pending.append(future)

    @rule()
    def hold_exports(self) -> None:
        async def hold() -> None:
            if self.fake.export_gate is None or self.fake.export_gate.is_set():
                self.fake.export_gate = anyio.Event()

        self.portal.call(hold)
        self._settle()

    @rule()
    def release_exports(self) -> None:
        async def release() -> None:
            if self.fake.export_gate is not None:
                self.fake.export_gate.set()

        self.portal.call(release)
        self._settle()

    @rule(hold=st.booleans())
    def hold_writes(self, hold: bool) -> None:
        if hold:
            self.write_gate.clear()
        else:
            self.write_gate.set()
        self._settle()

    @rule(seconds=st.sampled_from([1.0, 10.0, 45.0, 120.0]))
    def advance_clock(self, seconds: float) -> None:
        self.portal.call(self._advance, seconds)
        self._settle()

    async def _release_gate(self) -> None:
        assert self.fake.export_gate is not None
        self.fake.export_gate.set()

    async def _advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def closed_only_while_a_checkpoint_is_open(self) -> None:
        open_checkpoint = self.plane.phase is not Phase.IDLE or self.plane.checkpoint_id is not None
        if not open_checkpoint and not self.pending:
            assert self.fake.admission_open

    @invariant()
    def manifests_verify_and_hold_the_first_export(self) -> None:
        for manifest in self.root.rglob("manifest.json"):
            directory = manifest.parent
            share = read_participant_checkpoint(directory, kind="environment", instance="fake")
            checkpoint_id = share.manifest["checkpoint_id"]
            assert share.records == self.fake.first_export[checkpoint_id]

    @invariant()
    def resumed_before_publication_never_publishes(self) -> None:
        resumed = set(self.plane._resumed)
        for checkpoint_id in resumed:
            if checkpoint_id in self.unpublished_when_resumed:
                continue
            self.unpublished_when_resumed[checkpoint_id] = {
                self._directory(checkpoint_id, v)
                for v in (0, 1)
                if not list(self._directory(checkpoint_id, v).rglob("manifest.json"))
            }
        for directories in self.unpublished_when_resumed.values():
            for directory in directories:
                assert not list(directory.rglob("manifest.json")), directory

    @invariant()
    def marks_never_fall_except_through_forget(self) -> None:
        now = self.plane.marks.snapshot()
        for rollout, mark in self.marks.items():
            assert now.get(rollout, -1) >= mark, (rollout, mark, now)
        self.marks = dict(now)


ControlPlaneMachine.TestCase.settings = settings(
    max_examples=400 if SOAK else 25,
    stateful_step_count=40 if SOAK else 20,
    deadline=None,
)
TestControlPlaneSequences = ControlPlaneMachine.TestCase
