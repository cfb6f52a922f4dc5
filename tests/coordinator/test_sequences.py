"""In-process random sequences: four participants behind their routes, driven by the coordinator.

Each participant is the runtime's test fake (episodes whose steps block prepare) behind
``participant_app`` on an ``httpx.ASGITransport``, plus one data route (``start``) that applies its
retire marks, so refusals are observed over HTTP as a caller would see them. A seeded random
loop starts episodes, runs steps, checkpoints (prepare, commit, publish, resume), retires,
forgets, and crashes the whole deployment and restores it into fresh participants, with write,
close and install failures injected. After every step it checks control-plane §8.1:

1. no checkpoint open ⇒ every participant idle and admitting;
2. prepare closes in ``PREPARE_ORDER``, resume reopens in reverse;
3. a retired attempt is refused (``stale_attempt``) by every participant until forget;
4. a commit returns only scoped, non-retired episodes;
5. every manifest on disk verifies, and each published checkpoint verifies;
8. a failed restore leaves everyone open with nothing restored; a successful one restores only
   ``<rollout>-a<N+1>``, and the agent's and resources' restored sets are within the environment's.

A failure names its seed: rerun it with ``MIDFLIGHT_SEQUENCE_SEED=<seed>``.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from coordinator import (
    ControlClient,
    CoordinationError,
    Coordinator,
    Member,
    checkpoint_directory,
    publish_checkpoint,
    read_latest,
    verify_checkpoint,
)
from participants import ControlPlane, participant_app, read_participant_checkpoint
from protocols import (
    PREPARE_ORDER,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    MidflightError,
    ParticipantKind,
    Phase,
)

from ..participants.fakes import FakeParticipant
from .deployment import TOKEN, Router, _no_wait

KINDS: tuple[ParticipantKind, ...] = ("environment", "model", "agent", "resources")
ROLLOUTS = ("r0", "r1", "r2")
FAST_SEEDS = range(3)
SOAK_SEEDS = range(4, 204)
STEPS = 40


class SequenceFake(FakeParticipant):
    """The runtime fake under a kind and instance of its own, logging close and open."""

    def __init__(self, kind: ParticipantKind, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.kind = kind
        self.instance = kind
        self.log = log

    async def close_admission(self, request: CheckpointRequest) -> None:
        self.log.append(("close", self.kind))
        await super().close_admission(request)

    async def open_admission(self) -> None:
        self.log.append(("open", self.kind))
        await super().open_admission()


@dataclass
class Deployment:
    """One incarnation: fakes, planes, a router and a coordinator over them."""

    fakes: dict[str, SequenceFake]
    planes: dict[str, ControlPlane]
    router: Router
    coordinator: Coordinator
    log: list[tuple[str, str]]
    write_fault: dict[str, str] = field(default_factory=dict)

    async def start(self, episode: EpisodeId) -> str | None:
        """Start ``episode`` on every participant over HTTP; the first refusal's code or None."""
        for kind in KINDS:
            async with httpx.AsyncClient(transport=self.router, base_url=f"http://{kind}") as c:
                reply = await c.post(f"/ng-rollout/{episode.capture_key}/start")
            if reply.status_code != 200:
                code: str = reply.json()["error"]["code"]
                return code
        return None


def _add_start_route(app: FastAPI, fake: SequenceFake) -> None:
    @app.post("/ng-rollout/{capture_key}/start")
    async def start(capture_key: str) -> dict[str, str]:
        fake.start(EpisodeId.from_capture_key(capture_key))
        return {}


@asynccontextmanager
async def deployment() -> AsyncIterator[Deployment]:
    log: list[tuple[str, str]] = []
    router = Router()
    fakes: dict[str, SequenceFake] = {}
    planes: dict[str, ControlPlane] = {}
    write_fault: dict[str, str] = {}
    async with AsyncExitStack() as stack:
        for kind in KINDS:
            fake = SequenceFake(kind, log)

            def on_step(step: str, kind: str = kind) -> None:
                if write_fault.get(kind) == step:
                    raise OSError(5, f"injected write failure at {step}")

            plane = ControlPlane(fake, on_write_step=on_step)
            await stack.enter_async_context(plane.running())
            app = participant_app(plane, token=TOKEN)

            _add_start_route(app, fake)
            router.add(kind, app)
            fakes[kind], planes[kind] = fake, plane
        members = [
            Member(
                kind,
                kind,
                f"http://{kind}",
                ControlClient(f"http://{kind}", token=TOKEN, transport=router, wait=_no_wait()),
            )
            for kind in KINDS
        ]
        coordinator = Coordinator(members)
        stack.push_async_callback(coordinator.aclose)
        yield Deployment(fakes, planes, router, coordinator, log, write_fault)


class Violation(AssertionError):
    """An invariant of control-plane §8.1 did not hold."""


def check(condition: bool, rule: str, detail: Callable[[], str]) -> None:
    if not condition:
        raise Violation(f"{rule}: {detail()}")


class SequenceRun:
    """One seeded random sequence and the controller's model of what must hold."""

    def __init__(self, seed: int, root: Path) -> None:
        self.rng = random.Random(seed)
        self.root = root
        self.attempts = dict.fromkeys(ROLLOUTS, 0)
        self.retired: dict[str, int] = {}
        self.counter = 0
        self.published = 0

    def next_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    @staticmethod
    def deadline() -> float:
        return time.time() + 30

    # ------------------------------------------------------------------ invariants
    def check_open(self, d: Deployment) -> None:
        for kind in KINDS:
            check(
                d.planes[kind].phase == Phase.IDLE and d.fakes[kind].admission_open,
                "§8.1.1 open when no checkpoint is open",
                lambda kind=kind: f"{kind} is {d.planes[kind].phase}",
            )

    def check_orders(self, d: Deployment) -> None:
        closes = [kind for op, kind in d.log if op == "close"]
        opens = [kind for op, kind in d.log if op == "open"]
        check(
            closes == [k for k in PREPARE_ORDER if k in closes],
            "§8.1.2 prepare order",
            lambda: f"closed {closes}",
        )
        check(
            opens == [k for k in reversed(PREPARE_ORDER) if k in opens],
            "§8.1.2 resume order",
            lambda: f"opened {opens}",
        )
        d.log.clear()

    async def check_refusals(self, d: Deployment) -> None:
        for rollout, attempt in self.retired.items():
            code = await d.start(EpisodeId(rollout_id=rollout, attempt=attempt))
            check(
                code == "stale_attempt",
                "§8.1.3 retired attempts refused until forget",
                lambda rollout=rollout, attempt=attempt, code=code: f"{rollout}-a{attempt}: {code}",
            )

    def check_manifests(self) -> None:
        checkpoints = self.root / "checkpoints"
        for manifest in checkpoints.glob("*/gym/*/*/manifest.json"):
            share = read_participant_checkpoint(
                manifest.parent, kind=manifest.parent.parent.name, instance=manifest.parent.name
            )
            check(share is not None, "§8.1.5 manifest verifies", lambda m=manifest: str(m))
        for published in checkpoints.glob("*/checkpoint.json"):
            problems = verify_checkpoint(published.parent)
            check(not problems, "§8.1.5 published checkpoint verifies", lambda p=problems: str(p))

    # ------------------------------------------------------------------ operations
    def live(self, d: Deployment) -> list[EpisodeId]:
        return [e.episode for e in d.fakes["environment"].episodes.values()]

    async def op_start(self, d: Deployment) -> None:
        rollout = self.rng.choice(ROLLOUTS)
        episode = EpisodeId(rollout_id=rollout, attempt=self.attempts[rollout])
        if episode.capture_key in d.fakes["environment"].episodes:
            return
        code = await d.start(episode)
        refused = self.retired.get(rollout, -1) >= episode.attempt
        check(
            (code == "stale_attempt") == refused,
            "§8.1.3 marks",
            lambda: f"{episode.capture_key}: {code}, retired {self.retired}",
        )

    async def op_step(self, d: Deployment) -> None:
        live = sorted(d.fakes["environment"].episodes)
        if live:
            key = self.rng.choice(live)
            for fake in d.fakes.values():
                if key in fake.episodes:
                    episode = fake.episodes[key]
                    (fake.end_step if episode.in_step else fake.begin_step)(key)

    async def op_checkpoint(self, d: Deployment) -> None:
        checkpoint_id = self.next_id("ckpt")
        close_fault = self.rng.random() < 0.15
        if close_fault:  # an injected close failure on one participant
            d.fakes[self.rng.choice(KINDS)].fail_close = CheckpointError("injected close failure")
        try:
            # A step in progress blocks prepare until its deadline: keep that wait short.
            blocked = any(e.in_step for f in d.fakes.values() for e in f.episodes.values())
            deadline = time.time() + 0.5 if blocked else self.deadline()
            prepared = await d.coordinator.prepare(checkpoint_id, deadline)
        except CoordinationError as exc:
            check(close_fault, "prepare fails only on an injected failure", lambda e=exc: str(e))
            prepared = None
        for fake in d.fakes.values():
            fake.fail_close = None
        if prepared is None or not prepared.prepared:
            await d.coordinator.resume(checkpoint_id, self.deadline())
            return
        scope = self.live(d)
        retired = [
            EpisodeId(rollout_id=r, attempt=a)
            for r, a in self.retired.items()
            if self.rng.random() < 0.5
        ]
        scope = sorted(set(scope) | set(retired), key=lambda e: e.capture_key)
        if self.rng.random() < 0.15:  # an injected write failure on one participant
            d.write_fault[self.rng.choice(KINDS)] = self.rng.choice(
                ["records_synced", "manifest_temp_synced"]
            )
        directory = checkpoint_directory(self.root, checkpoint_id)
        try:
            replies = await d.coordinator.commit(
                checkpoint_id, self.deadline(), str(directory), scope
            )
        except CoordinationError as exc:
            check(
                bool(d.write_fault),
                "commit fails only on an injected failure",
                lambda e=exc: str(e),
            )
            replies = None
        d.write_fault.clear()
        if replies is not None:
            keys = {e.capture_key for e in scope}
            for kind, reply in replies.items():
                for key in reply.episode_ids:
                    episode = EpisodeId.from_capture_key(key)
                    check(
                        key in keys and self.retired.get(episode.rollout_id, -1) < episode.attempt,
                        "§8.1.4 commit returns scoped, non-retired episodes",
                        lambda kind=kind, key=key: f"{kind} returned {key}",
                    )
            exported = {e for r in replies.values() for e in r.episode_ids}
            continued = [e for e in scope if e.capture_key in exported]
            await publish_checkpoint(
                self.root, checkpoint_id, d.coordinator.members, replies, continued, {}
            )
            self.published += 1
        await d.coordinator.resume(checkpoint_id, self.deadline())

    async def op_retire(self, d: Deployment) -> None:
        rollout = self.rng.choice(ROLLOUTS)
        episode = EpisodeId(rollout_id=rollout, attempt=self.attempts[rollout])
        await d.coordinator.retire(self.next_id("retire"), self.deadline(), [episode])
        self.retired[rollout] = max(self.retired.get(rollout, -1), episode.attempt)
        self.attempts[rollout] += 1  # the straggler reruns as its next attempt

    async def op_forget(self, d: Deployment) -> None:
        if self.retired:
            rollout = self.rng.choice(sorted(self.retired))
            await d.coordinator.forget(self.next_id("forget"), self.deadline(), [rollout])
            del self.retired[rollout]
            for plane in d.planes.values():
                check(
                    rollout not in plane.marks.snapshot(),
                    "§8.1.3 forget removes the mark",
                    lambda plane=plane: str(plane.marks.snapshot()),
                )

    async def crash_and_restore(self, fresh: Deployment) -> None:
        """Restore LATEST into ``fresh`` (all or nothing), maybe with an install failure."""
        # The marks lived in the dead processes; the fresh ones hold only what the restore adds.
        self.retired = {}
        latest = read_latest(self.root)
        if latest is None:
            return
        scope = list(latest.continued)
        failing = self.rng.choice(KINDS) if self.rng.random() < 0.3 else None
        if failing is not None:
            fresh.fakes[failing].fail_install = CheckpointError("injected install failure")
        restore_id = self.next_id("restore")
        directory = checkpoint_directory(self.root, latest.checkpoint_id)
        try:
            replies = await fresh.coordinator.restore(
                restore_id, self.deadline(), str(directory), scope
            )
        except CoordinationError as exc:
            check(
                failing is not None,
                "restore fails only on an injected failure",
                lambda e=exc: str(e),
            )
            replies = None
        fresh.fakes[failing or "environment"].fail_install = None
        for episode in scope:
            self.attempts[episode.rollout_id] = episode.attempt + 1
        if replies is None:
            for kind in KINDS:
                check(
                    not fresh.fakes[kind].restored,
                    "§7.2 failed restore installs nothing",
                    lambda kind=kind: f"{kind}: {sorted(fresh.fakes[kind].restored)}",
                )
            for episode in scope:  # the failed restore retired N+1: the rollout reruns as N+2
                self.retired[episode.rollout_id] = episode.attempt + 1
                self.attempts[episode.rollout_id] = episode.attempt + 2
            return
        restored = {kind: set(reply.restored) for kind, reply in replies.items()}
        targets = {e.next_attempt().capture_key for e in scope}
        for keys in restored.values():
            check(keys <= targets, "§7.2 restored keys are N+1", lambda keys=keys: str(keys))
        for kind in ("agent", "resources"):
            check(
                restored[kind] <= restored["environment"],
                "§7.2 restored subsets",
                lambda kind=kind: f"{kind} {restored[kind]} ⊄ {restored['environment']}",
            )
        for episode in scope:  # restore fences attempt N (e2e-contract §6)
            self.retired[episode.rollout_id] = episode.attempt
        await fresh.coordinator.resume(restore_id, self.deadline())


OPERATIONS = {"start": 5, "step": 4, "checkpoint": 3, "retire": 1, "forget": 1, "crash": 1}


async def run_sequence(seed: int) -> None:
    root = Path(tempfile.mkdtemp(prefix=f"midflight-seq-{seed}-"))
    run = SequenceRun(seed, root)
    names, weights = list(OPERATIONS), list(OPERATIONS.values())
    try:
        async with AsyncExitStack() as stack:
            d = await stack.enter_async_context(deployment())
            for step in range(STEPS):
                name = run.rng.choices(names, weights)[0]
                try:
                    if name == "crash":
                        d = await stack.enter_async_context(deployment())
                        await run.crash_and_restore(d)
                    else:
                        await getattr(run, f"op_{name}")(d)
                    run.check_open(d)
                    if name == "crash":  # restore closes everyone at once: no order to check
                        d.log.clear()
                    run.check_orders(d)
                    await run.check_refusals(d)
                    run.check_manifests()
                except (Violation, MidflightError, CoordinationError) as exc:
                    raise AssertionError(
                        f"sequence seed {seed} failed at step {step} ({name}): {exc}"
                    ) from exc
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", FAST_SEEDS)
async def test_random_sequences_keep_the_control_plane_invariants(seed: int) -> None:
    await run_sequence(int(os.environ.get("MIDFLIGHT_SEQUENCE_SEED", seed)))


@pytest.mark.soak
@pytest.mark.anyio
@pytest.mark.parametrize("seed", SOAK_SEEDS)
async def test_many_random_sequences_keep_the_control_plane_invariants(seed: int) -> None:
    await run_sequence(seed)
