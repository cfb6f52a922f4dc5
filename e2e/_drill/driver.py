"""The rollout driver: the training controller of the drill, run as its own process.

It dispatches ``/run`` per rollout, checkpoints while model calls are in flight, and after a crash
rolls its state back to the restored checkpoint, restores the servers, re-dispatches the continued
episodes as their next attempt, retires every other logged unfinished attempt, and probes the
fenced attempts on every kind. It logs (fsynced) all it does to ``<root>/evidence/driver.jsonl``.

The drill talks to it through stdout lines: ``checkpointed <id>``, ``crash-point`` (kill me now)
and ``done``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import anyio.lowlevel

from coordinator import (
    CheckpointTrace,
    CoordinationError,
    PrepareResult,
    checkpoint_trace,
    hosted_on_ray,
    send_while_out_of_time,
)
from protocols import EpisodeId, open_store

from .._launch.loop_watch import run_watched
from .._servers.cluster import (
    DEFAULT_NAMES,
    ROLES,
    Cluster,
    ServerEntry,
    read_cluster,
)
from .._servers.evidence import read_evidence
from .._trace.setup import configure_tracing
from .control import OUT_OF_TIME_SENDS, CommitOutcome
from .dispatch import DEADLINE_SECONDS, RolloutDispatcher
from .hosting import RAY_NAMESPACE_ENV
from .plan import ControllerState, DriverPlan, task_of
from .probes import ResourcesProbe, send_probes

CUT_RETRIES = 6
"""Commits a phase may abandon so that the checkpoint its crash restores carries a cut and a
delivered call (D155, D232, D360); the last try is published whatever it carries."""


def remove_checkpoint(location: str) -> None:
    """Remove an abandoned, unpublished checkpoint: its directory, or its objects."""
    open_store(location).delete_tree("")


def _cuts_taken(prepared: PrepareResult) -> int:
    """The generations the model server cut when it closed admission (its ``cut`` count)."""
    return sum(reply.report.counts.get("cut", 0) for reply in prepared.replies.values())


class Driver(RolloutDispatcher):
    """One incarnation of the controller: dispatch (the base), checkpoints and recovery."""

    async def checkpoint(
        self, index: int, *, block: float | None = None, for_crash: bool = False
    ) -> bool:
        """Take checkpoint ``index`` of this phase; False when it was not published.

        ``block`` forces the rarer outcome: the controller treats the prepare as blocked by the
        attempt of its scope that ``block`` (in [0, 1)) picks, and does what it does for a real
        straggler (control-plane §3.4.1: resume, retire it, dispatch its next attempt).
        ``for_crash``: the checkpoint a crash will restore. A commit that exported episodes but
        carries no generation cut, or no delivered call, is abandoned before publication (resumed,
        its directory removed), so that the restore has a cut to continue and a delivered call
        that must not run again, and the published count stays what the plan asked for (D155,
        D232, D247, D360).
        """
        checkpoint_id = f"ckpt-{self.plan.phase}-{index}"
        with checkpoint_trace(checkpoint_id) as traced:  # one checkpoint, one trace
            published = await self._checkpoint(checkpoint_id, traced, block, for_crash)
            traced.record(published=published)
            return published

    async def _checkpoint(
        self, checkpoint_id: str, traced: CheckpointTrace, block: float | None, for_crash: bool
    ) -> bool:
        directory = self.control.checkpoint_dir(self.checkpoints_at, checkpoint_id)
        deadline = time.time() + DEADLINE_SECONDS
        scope = {**self.owed, **self.in_flight}  # dispatched, or restored and still to dispatch
        self.admission.close()
        prepared = await self.control.prepare(checkpoint_id, deadline)
        forced: list[EpisodeId] = []
        candidates = self.retirable()  # none finished meanwhile, none being accepted
        if block is not None and prepared.prepared and candidates:
            rollout, attempt = candidates[min(len(candidates) - 1, int(block * len(candidates)))]
            forced = [EpisodeId(rollout_id=rollout, attempt=attempt)]
        if not prepared.prepared or forced:
            await self._resume(checkpoint_id)
            stragglers = forced or prepared.blocking_episodes()
            await self.log(
                {
                    "event": "prepare_blocked",
                    "id": checkpoint_id,
                    "blockers": [e.capture_key for e in stragglers],
                    "forced": bool(forced),
                }
            )
            if stragglers:
                for episode in stragglers:
                    self.retired[episode.rollout_id] = episode.attempt
                await self.control.retire(f"retire-{checkpoint_id}", stragglers)
            return False
        # A rollout some server cannot capture (a restart-only resources server) stays out of the
        # commit scope: after a crash it is retired and run again from its input.
        restarts = {e.capture_key for e in prepared.restarts()}
        in_scope = [EpisodeId(rollout_id=r, attempt=a) for r, a in sorted(scope.items())]
        episodes = prepared.continued(in_scope)
        # The model server cuts the generations still running when its admission closes: with
        # none cut (on a loaded machine they can all finish while the environment parks), this
        # commit could carry no cut, so it is not made at all and another is taken.
        if for_crash and episodes and not _cuts_taken(prepared):
            return await self._abandon(checkpoint_id, "no cut")
        # A controller saves its own state between prepare and commit; meanwhile the generations
        # in flight finish and their responses are held, so the commit must leave their rows out.
        await anyio.sleep(self.plan.commit_delay_s)
        commit = await self._commit(checkpoint_id, deadline, directory, episodes)
        self.last_cuts = commit.generation_cut_episodes()
        exported = set(commit.environment_episode_ids())
        # Only exported episodes carry cuts: a commit of restarts alone is published as is. One
        # taken while every rollout waits on its first call has no delivered call (D360).
        if for_crash and exported:
            figures = await self.control.share_figures(directory) if self.last_cuts else None
            if figures is None or not figures.cut_tokens:  # D404
                return await self._abandon(checkpoint_id, "no cut", directory)
            if not figures.delivered_calls:
                return await self._abandon(checkpoint_id, "no delivered call", directory)
        await self._wait_on_the_wire(
            rollout
            for rollout, attempt in scope.items()
            if (key := EpisodeId(rollout_id=rollout, attempt=attempt).capture_key) not in exported
            and key not in restarts
            and rollout in self.done_events
        )
        continued = [e for e in episodes if e.capture_key in exported]
        state = ControllerState(
            accepted=dict(self.state.accepted), attempts=dict(self.state.attempts)
        )
        await self.control.publish(
            self.checkpoints_at,
            checkpoint_id,
            commit,
            continued,
            state.to_json(),
            traced.traceparent,
        )
        traced.record(rollouts=len(continued))
        await self.log(
            {
                "event": "checkpoint",
                "id": checkpoint_id,
                "dir": str(directory),
                "scope": [e.capture_key for e in episodes],
                "continued": [e.capture_key for e in continued],
                "restarts": sorted(restarts),
                "generation_cuts": self.last_cuts,
            }
        )
        await self._resume(checkpoint_id)
        self.say(f"checkpointed {checkpoint_id}")
        return True

    async def _commit(
        self, checkpoint_id: str, deadline: float, directory: str, episodes: list[EpisodeId]
    ) -> CommitOutcome:
        """Commit; a commit every refusing participant refused for time alone is sent again.

        A prepare that waited long for thousands of episodes to park can leave the commit a
        second of the checkpoint's deadline. Each participant that ran out of time keeps writing
        what it exported, so the same commit, sent again with a fresh deadline, finds the write
        and waits for it instead of exporting again (D388).

        Raises:
            CoordinationError: Any other refusal, or still out of time after
                ``OUT_OF_TIME_SENDS``.
        """

        async def logged(error: CoordinationError) -> None:
            refused = sorted(error.failures)
            await self.log({"event": "commit_retried", "id": checkpoint_id, "refused": refused})

        return await send_while_out_of_time(
            lambda deadline: self.control.commit(checkpoint_id, deadline, directory, episodes),
            deadline,
            seconds=DEADLINE_SECONDS,
            sends=OUT_OF_TIME_SENDS,
            on_resend=logged,
        )

    async def _resume(self, checkpoint_id: str) -> None:
        """Resume a checkpoint of this controller, then send the runs it refused (D402)."""
        await self.control.resume(checkpoint_id, time.time() + DEADLINE_SECONDS)
        self.admission.open()

    async def _wait_on_the_wire(self, rollouts: Iterable[str]) -> None:
        """Let replies on the wire finish first: each rollout left out of the export until it
        ends or is refused, within ``DEADLINE_SECONDS`` of its own, all at once (D402)."""

        async def one(rollout: str) -> None:
            with anyio.move_on_after(DEADLINE_SECONDS):
                await self.finished_or_refused(rollout)

        async with anyio.create_task_group() as group:
            for rollout in rollouts:
                group.start_soon(one, rollout)

    async def _abandon(self, checkpoint_id: str, why: str, committed: str | None = None) -> bool:
        """Resume without publishing (removing what was ``committed``, if anything); False."""
        await self._resume(checkpoint_id)
        if committed is not None:
            await anyio.to_thread.run_sync(remove_checkpoint, committed)
        await self.log({"event": "checkpoint_abandoned", "id": checkpoint_id, "why": why})
        self.abandoned += 1
        return False

    # ------------------------------------------------------------------ recovery
    async def recover(self) -> list[tuple[str, int]]:
        """Restore from LATEST; return the (rollout, attempt) pairs to dispatch first."""
        latest = await self.control.read_latest(self.checkpoints_at)
        self.state = ControllerState.from_json(latest["controller_state"])
        restarts = self.restarts_of(latest["checkpoint_id"])
        continued = [EpisodeId.model_validate(e) for e in latest["continued"]]
        restore_id = f"restore-{self.plan.phase}"
        restored: list[str] = []
        if self.plan.fault != "rerun-from-input":
            restored = await self.control.restore(
                restore_id,
                time.time() + DEADLINE_SECONDS,
                latest["checkpoint_dir"],
                continued,
            )
            await self.control.resume(restore_id, time.time() + DEADLINE_SECONDS)
        await self.log(
            {
                "event": "restore",
                "checkpoint_id": latest["checkpoint_id"],
                "checkpoint_dir": latest["checkpoint_dir"],
                "restored": restored,
                "checkpoint_t": latest.get("created_at", 0.0),
            }
        )
        logged: dict[str, int] = {}
        for event in read_evidence(self.evidence.path):
            if event.get("event") == "dispatch":
                logged[event["rollout"]] = max(logged.get(event["rollout"], -1), event["attempt"])
        continued_rollouts = {e.rollout_id for e in continued} if restored else set()
        to_retire = [
            EpisodeId(rollout_id=r, attempt=a)
            for r, a in sorted(logged.items())
            if r not in self.state.accepted and r not in continued_rollouts
        ]
        if to_retire:
            await self.control.retire(f"retire-{restore_id}", to_retire)
        restarted = sorted(e.capture_key for e in to_retire if e.rollout_id in restarts)
        await self.log({"event": "restarted", "crash": self.plan.phase, "rollouts": restarted})
        await self.probe_stale([*continued[:2], *to_retire[:1]])
        plan: list[tuple[str, int]] = []
        for episode in continued:
            if episode.rollout_id in continued_rollouts:
                plan.append((episode.rollout_id, episode.attempt + 1))
                self.owed[episode.rollout_id] = episode.attempt + 1
        for episode in to_retire:
            plan.append((episode.rollout_id, episode.attempt + 1))
        return plan

    def restarts_of(self, checkpoint_id: str) -> set[str]:
        """The rollouts the checkpoint ``checkpoint_id`` reported as restarts (from evidence)."""
        return {
            EpisodeId.from_capture_key(key).rollout_id
            for event in read_evidence(self.evidence.path)
            if event.get("event") == "checkpoint" and event.get("id") == checkpoint_id
            for key in event.get("restarts", [])
        }

    async def probe_stale(self, fenced: list[EpisodeId]) -> None:
        """Send late requests of fenced attempts to every participant kind; log each answer."""
        for episode in fenced:
            await self.send_probes(episode, "tool", within=60.0)

    async def send_probes(
        self,
        episode: EpisodeId,
        resources: ResourcesProbe,
        *,
        within: float,
        after: str | None = None,
    ) -> dict[str, tuple[int, str | None]]:
        """Probe every kind with a late request of ``episode``; log and return (status, code)."""
        task = task_of(episode.rollout_id, self.plan.task_input)
        answers = await send_probes(self.http, self.cluster, episode, task, resources, within)
        for kind, (status, code) in answers.items():
            event = {
                "event": "stale_probe",
                "crash": self.plan.phase,
                "kind": kind,
                "key": episode.capture_key,
                "status": status,
                "code": code,
                "accepted": status < 400,
            }
            await self.log(event if after is None else {**event, "after": after})
        return answers

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        await self.control.coordinator()  # discovered now, not inside a prepare's deadline (D408)
        first = await self.recover() if self.plan.phase > 0 else []
        self.say_progress()
        async with anyio.create_task_group() as group:
            pending = [r for r in self.plan.rollouts if r not in self.state.accepted]
            queued = dict(first)
            for rollout in pending:
                queued.setdefault(rollout, self.state.attempts.get(rollout, 0))
            order = [r for r, _ in first] + [r for r in pending if r not in dict(first)]

            async def dispatcher() -> None:
                for rollout in order:
                    while len(self.in_flight) >= self.plan.concurrency:
                        self.filled.set()
                        self.wake = anyio.Event()
                        await self.wake.wait()
                    attempt = queued[rollout]
                    self.state.attempts[rollout] = attempt
                    group.start_soon(self.run_rollout, rollout, attempt)
                    await anyio.lowlevel.checkpoint()
                self.filled.set()

            group.start_soon(dispatcher)
            await self.wait_until_filled()
            taken = index = 0
            while taken < self.plan.checkpoints:
                if not await self.wait_for_model_calls_in_flight():
                    if self.plan.crash_after and not taken:
                        # Every rollout finished, or none reached the model for a minute, before
                        # a checkpoint with a cut was taken: the crash still needs one to restore,
                        # so one is published as it is (D383).
                        await self.checkpoint(index)
                    break
                # The checkpoint a crash restores should carry a generation cut and a delivered
                # call, or the run cannot show a cut continued and no call repeated; on a busy
                # machine the calls may all finish before admission closes, or all still be on
                # their first generation, so that commit is abandoned and taken again (bounded).
                last = taken == self.plan.checkpoints - 1 and self.plan.crash_after
                for_crash = last and self.abandoned < CUT_RETRIES
                if await self.checkpoint(index, for_crash=for_crash):
                    taken += 1
                index += 1
                await anyio.sleep(0.05)
            if self.plan.crash_after:
                await anyio.sleep(0.2)  # let some calls be delivered after the checkpoint
                self.say("crash-point")
                await anyio.sleep_forever()
        await self.finish()

    async def finish(self) -> None:
        """Retire every finished attempt, forget, check that nothing is left, log the final state."""
        retire = [
            EpisodeId(rollout_id=r, attempt=v["attempt"])
            for r, v in sorted(self.state.accepted.items())
        ]
        if retire:
            await self.control.retire("retire-final", retire)
            await self.control.forget("forget-final", sorted(self.state.accepted))
        leftover = await self.control.leftover(self.root)
        await self.log({"event": "final", "accepted": self.state.accepted, "leftover": leftover})
        self.say("done")


def cluster_on_ray(root: Path, namespace: str, plan: DriverPlan) -> Cluster:
    """The servers hosted in the Ray namespace, ordered as the supervisor's cluster file is:
    by role in start-up order, each role's default server first."""
    servers = hosted_on_ray(namespace)
    entries = [
        ServerEntry(s.name, s.role, s.url, dict(s.options)) for s in servers if s.role in ROLES
    ]
    entries.sort(key=lambda e: (ROLES.index(e.role), e.name != DEFAULT_NAMES[e.role], e.name))
    return Cluster(root, tuple(entries), plan.checkpoint_root or None)


def main(root: Path, cluster_path: Path, plan_path: Path) -> None:
    """Run one driver incarnation (``midflight drill-driver``)."""
    token = os.environ["MIDFLIGHT_CONTROL_TOKEN"]
    configure_tracing("midflight-driver", server="driver")  # traced when the drill is
    namespace = os.environ.get(RAY_NAMESPACE_ENV)
    plan = DriverPlan.load(plan_path)
    # On Ray, the controller finds the servers as a training controller would: from Ray.
    cluster = read_cluster(cluster_path) if not namespace else cluster_on_ray(root, namespace, plan)
    driver = Driver(root, cluster, plan, token)
    anyio.run(run_watched, driver.run, "controller")  # its stalls go to its log (D410)
