"""The controller of one random sequence: the drill's driver executing a plan of operations.

``midflight drill --sequences N`` hands each driver incarnation the operations left in its
sequence (``start``, ``finish``, ``checkpoint``, ``crash``, ``retire``). The driver applies them one
by one and, after each, checks what control-plane §8.1 lets it observe from outside:

- ``open_when_idle`` (item 1): no checkpoint is open, so every participant reports ``idle``;
- ``commit_scope`` (item 4): every commit reply names only episodes of the scope it was given,
  and none the controller retired or a restore fenced;
- ``manifests_verify`` (item 5): a checkpoint just published verifies with the reader;
- ``retire_refuses`` (item 3): right after a retire, and again just before the final forget,
  every participant kind refuses the retired attempt with ``stale_attempt``.

Each check that fails is logged (fsynced) as a ``violation`` event; the orchestrator in
``_sequences.py`` reads them back with the drill's figures. A ``crash`` op publishes a checkpoint
and then asks to be SIGKILLed with ``crash-at <index>``; the next incarnation restores and goes on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coordinator import verify_checkpoint
from protocols import EpisodeId

from .._drill.control import CommitOutcome, ControlSession
from .._drill.dispatch import DEADLINE_SECONDS
from .._drill.driver import Driver
from .._drill.plan import DriverPlan
from .._launch.loop_watch import run_watched
from .._servers.cluster import Cluster, read_cluster

OPERATIONS = ("start", "finish", "checkpoint", "crash", "retire")
"""Every operation a sequence may hold."""
DRAIN_SECONDS = 300.0


class CheckedControl(ControlSession):
    """The drill's control session, checking every commit reply against its scope (§8.1.4)."""

    def __init__(self, cluster: Cluster, token: str, driver: SequenceDriver) -> None:
        super().__init__(cluster, token)
        self._driver = driver

    async def commit(
        self, checkpoint_id: str, deadline: float, directory: str, episodes: Sequence[EpisodeId]
    ) -> CommitOutcome:
        outcome = await super().commit(checkpoint_id, deadline, directory, episodes)
        scope = {episode.capture_key for episode in episodes}
        for name, reply in sorted(outcome.replies.items()):
            for key in reply.episode_ids:
                episode = EpisodeId.from_capture_key(key)
                if key not in scope:
                    await self._driver.violation("commit_scope", f"{name} returned {key} outside")
                elif self._driver.is_refused(episode):
                    await self._driver.violation("commit_scope", f"{name} returned retired {key}")
        return outcome


class SequenceDriver(Driver):
    """One controller incarnation running the operations of a sequence."""

    def __init__(
        self,
        root: Path,
        cluster: Cluster,
        plan: DriverPlan,
        token: str,
        ops: list[dict[str, Any]],
        first_index: int,
    ) -> None:
        super().__init__(root, cluster, plan, token)
        self.control = CheckedControl(cluster, token, self)
        self.ops = ops
        self.first_index = first_index
        self.tried = (
            0  # checkpoint ids of this incarnation: a blocked one's id is resumed, never reused
        )
        self.running: set[str] = set()
        self.fenced: dict[str, int] = {}
        self.step = -1

    def is_refused(self, episode: EpisodeId) -> bool:
        """Whether the controller retired ``episode`` or a restore fenced it."""
        mark = max(
            self.retired.get(episode.rollout_id, -1), self.fenced.get(episode.rollout_id, -1)
        )
        return episode.attempt <= mark

    async def violation(self, rule: str, detail: str) -> None:
        """Log one failed invariant check."""
        await self.log({"event": "violation", "rule": rule, "step": self.step, "detail": detail})

    # ------------------------------------------------------------------ operations
    def dispatch(self, group: TaskGroup, rollout: str, attempt: int) -> None:
        self.state.attempts[rollout] = attempt
        self.running.add(rollout)

        async def one() -> None:
            try:
                await self.run_rollout(rollout, attempt)
            finally:
                self.running.discard(rollout)
                self.wake.set()

        group.start_soon(one)

    def pending(self) -> list[str]:
        """Rollouts with no accepted result and nothing running, in plan order."""
        return [
            r for r in self.plan.rollouts if r not in self.state.accepted and r not in self.running
        ]

    async def wait_for_change(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            self.wake = anyio.Event()
            await self.wake.wait()

    async def apply(self, group: TaskGroup, op: dict[str, Any]) -> bool:
        """Apply one operation; True when the driver must now be crashed."""
        name = op["op"]
        if name == "start":
            for rollout in self.pending()[: op.get("count", 1)]:
                self.dispatch(group, rollout, self.state.attempts.get(rollout, 0))
        elif name == "finish":
            accepted = len(self.state.accepted)
            with anyio.move_on_after(60.0):
                while self.running and len(self.state.accepted) == accepted:
                    await self.wait_for_change(1.0)
        elif name in ("checkpoint", "crash"):
            if self.in_flight:  # checkpoint while model calls run, when there are any
                with anyio.move_on_after(10.0):
                    while self.in_flight:
                        if await self.control.model_calls_in_flight() > 0:
                            break
                        await anyio.sleep(0.01)
            index = self.tried
            self.tried += 1
            published = await self.checkpoint(index, block=op.get("block"))
            if published:
                directory = self.control.checkpoint_dir(
                    self.root, f"ckpt-{self.plan.phase}-{index}"
                )
                problems = await anyio.to_thread.run_sync(verify_checkpoint, directory)
                for problem in problems:
                    await self.violation("manifests_verify", problem)
            if name == "crash":
                return (self.root / "checkpoints" / "LATEST").exists()
        elif name == "retire":
            await self.retire_one(op.get("pick", 0.0))
        return False

    async def retire_one(self, pick: float) -> None:
        """Retire one in-flight attempt; it reruns as its next attempt (a straggler)."""
        candidates = [(r, a) for r, a in self.retirable() if self.in_flight.get(r) == a]
        if not candidates:
            return
        rollout, attempt = candidates[min(len(candidates) - 1, int(pick * len(candidates)))]
        episode = EpisodeId(rollout_id=rollout, attempt=attempt)
        self.retired[rollout] = episode.attempt
        await self.log({"event": "retire", "key": episode.capture_key})
        await self.control.retire(f"retire-seq-{self.plan.phase}-{self.step}", [episode])
        await self.probe_refused(episode)

    async def probe_refused(self, episode: EpisodeId) -> None:
        """Send the attempt a request of every kind; each must answer ``stale_attempt``."""
        answers = await self.send_probes(episode, "seed", within=DEADLINE_SECONDS, after="retire")
        for kind, (status, code) in answers.items():
            if code != "stale_attempt":
                await self.violation(
                    "retire_refuses", f"{kind} answered {status} {code} for {episode.capture_key}"
                )

    async def check_open(self) -> None:
        """§8.1.1: no checkpoint is open between operations, so every participant is idle."""
        for server in self.cluster.servers:
            if server.role == "worker":
                continue
            status = await self.control._status(server.url)
            if status["phase"] != "idle":
                await self.violation(
                    "open_when_idle", f"{server.name} is {status['phase']} between operations"
                )

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        first: list[tuple[str, int]] = []
        if self.plan.phase > 0:
            first = await self.recover()
            latest = await self.control.read_latest(self.root)
            for item in latest["continued"]:  # the restore fenced attempt N of its scope
                episode = EpisodeId.model_validate(item)
                self.fenced[episode.rollout_id] = episode.attempt
        async with anyio.create_task_group() as group:
            for rollout, attempt in first:
                self.dispatch(group, rollout, attempt)
            for offset, op in enumerate(self.ops):
                self.step = self.first_index + offset
                crash = await self.apply(group, op)
                await self.check_open()
                await self.log({"event": "step", "index": self.step, "op": op, "crash": crash})
                if crash:
                    await anyio.sleep(0.2)  # let some calls be delivered after the checkpoint
                    self.say(f"crash-at {self.step}")
                    await anyio.sleep_forever()
            self.step = self.first_index + len(self.ops)
            with anyio.move_on_after(DRAIN_SECONDS):
                while not self.finished():
                    for rollout in self.pending():
                        self.dispatch(group, rollout, self.state.attempts.get(rollout, 0))
                    await self.wait_for_change(1.0)
        # The marks hold until forget: every attempt retired in this incarnation is still refused.
        for rollout, attempt in sorted(self.retired.items()):
            await self.probe_refused(EpisodeId(rollout_id=rollout, attempt=attempt))
        await self.finish()


def main(root: Path, cluster_path: Path, plan_path: Path) -> None:
    """Run one sequence-driver incarnation (``midflight sequence-driver``)."""
    token = os.environ["MIDFLIGHT_CONTROL_TOKEN"]
    data = json.loads(plan_path.read_text())
    ops = data.pop("ops")
    first_index = data.pop("first_index")
    plan = DriverPlan(**data)
    driver = SequenceDriver(root, read_cluster(cluster_path), plan, token, ops, first_index)
    anyio.run(run_watched, driver.run, "controller")  # its stalls go to its log (D410)
