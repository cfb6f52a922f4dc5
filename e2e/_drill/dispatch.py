"""The dispatching half of the rollout driver: one ``/run`` per attempt, and what it leaves behind.

Every dispatch is logged (fsynced) to the driver's evidence before it is sent; an attempt that
meets a closed admission or a retire is re-dispatched as the driver decides
(``e2e._drill.driver``).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import httpx
from opentelemetry import trace

from coordinator import HttpClient, http_transport
from protocols import ROLLOUT_SPAN, EpisodeId

from .._servers.cluster import Cluster
from .._servers.evidence import EvidenceLog
from .._servers.peer_pool import PEER_POOL
from .._trace.propagation import TRACE_HOOKS
from .control import ControlSession
from .plan import ControllerState, DriverPlan, error_code, error_detail, task_of

DEADLINE_SECONDS = 30.0
_TRACER = trace.get_tracer("midflight.drill")

FIRST_PAUSE_S = 0.05
LAST_PAUSE_S = 1.0
"""A ``/run`` that is refused for a closed admission, or whose connection was never made, is
sent again after a pause that doubles from 50 ms to 1 s, each drawn from 0.5 to 1.5 times its
size (D372). A fixed 50 ms made 2,000 refused rollouts send 40,000 requests a second at one
environment server while a checkpoint held its admission closed, and new connections to it
then timed out."""


FILL_WAIT_S: Final = 120.0
"""The longest a phase waits for its dispatcher to fill before its first checkpoint (D403)."""
REOPEN_WAIT_S: Final = 120.0
"""The longest a ``/run`` refused while this controller holds admission closed waits for the
controller's own resume before it is sent again anyway (D402)."""


class AdmissionGate:
    """Whether this controller holds admission closed: from its prepare until its resume.

    A ``/run`` refused meanwhile is sent again once the gate opens, spread over a pause, instead
    of every second while the checkpoint lasts (D402).
    """

    def __init__(self) -> None:
        self._open = anyio.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        """Whether no checkpoint of this controller holds admission closed."""
        return self._open.is_set()

    def close(self) -> None:
        """A prepare is about to be sent."""
        if self._open.is_set():
            self._open = anyio.Event()

    def open(self) -> None:
        """The resume that follows it returned."""
        self._open.set()

    async def wait_open(self, within: float) -> None:
        """Wait until the gate opens, at most ``within`` seconds."""
        with anyio.move_on_after(within):
            await self._open.wait()


def next_pause(pause: float) -> float:
    """The pause after ``pause``: doubled, at most ``LAST_PAUSE_S``."""
    return min(pause * 2, LAST_PAUSE_S)


def jittered(pause: float) -> float:
    """``pause`` spread over half to one and a half of itself, so refused rollouts drift apart."""
    return pause * random.uniform(0.5, 1.5)  # noqa: S311 - timing only, never an outcome


class RolloutDispatcher:
    """The dispatching half of a driver incarnation: one ``/run`` per attempt, its evidence."""

    def __init__(self, root: Path, cluster: Cluster, plan: DriverPlan, token: str) -> None:
        self.root = root
        self.checkpoints_at: Path | str = plan.checkpoint_root or root
        """Where the checkpoints are: the run root, or the ``s3://`` root the plan names."""
        self.cluster = cluster
        self.plan = plan
        self.token = token
        self.evidence = EvidenceLog(root / "evidence" / "driver.jsonl")
        self.state = ControllerState()
        self.in_flight: dict[str, int] = {}
        self.settling: dict[str, int] = {}  # replied with a result, being accepted
        # Restored attempts not yet running: every commit names them (their replacement attempt)
        # until they start, or the commit deletes their restored state (control-plane §5).
        self.owed: dict[str, int] = {}
        self.done_events: dict[str, anyio.Event] = {}
        self.refused_events: dict[str, anyio.Event] = {}  # set when /run meets a closed admission
        self.admission = AdmissionGate()
        self.filled = anyio.Event()  # set once the dispatcher reached its concurrency (D403)
        self.control = ControlSession(cluster, token)
        self.http = HttpClient(  # no connect retries: a /run never sent is resent (D372)
            timeout=httpx.Timeout(900.0, connect=10.0),
            transport=http_transport(PEER_POOL),
            event_hooks=TRACE_HOOKS,
        )
        self.wake = anyio.Event()
        self.retired: dict[str, int] = {}
        self.last_cuts: list[str] = []
        self.abandoned = 0  # commits abandoned for want of a cut or a delivered call (one phase)

    async def log(self, event: dict[str, Any]) -> None:
        """Append one evidence line (fsynced) before acting on it."""
        await anyio.to_thread.run_sync(self.evidence.append, {**event, "t": time.time()})

    @staticmethod
    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def say_progress(self) -> None:
        """``progress <accepted>/<rollouts>``: what the drill's bar shows (after a rollback too)."""
        self.say(f"progress {len(self.state.accepted)}/{len(self.plan.rollouts)}")

    # ------------------------------------------------------------------ dispatch
    async def run_rollout(self, rollout: str, attempt: int) -> None:
        """Run a rollout to an accepted result; a retired straggler reruns as its next attempt."""
        while True:
            await self.run_attempt(rollout, attempt)
            if rollout in self.state.accepted or self.retired.get(rollout, -1) < attempt:
                return
            attempt += 1
            self.state.attempts[rollout] = attempt

    async def run_attempt(self, rollout: str, attempt: int) -> None:
        """Run one attempt in its span: its data-plane calls, across every server, are children."""
        with _TRACER.start_as_current_span(
            ROLLOUT_SPAN, attributes={"midflight.rollout_id": rollout, "midflight.attempt": attempt}
        ):
            await self._run_attempt(rollout, attempt)

    async def _run_attempt(self, rollout: str, attempt: int) -> None:
        episode = EpisodeId(rollout_id=rollout, attempt=attempt)
        self.in_flight[rollout] = attempt
        if self.owed.get(rollout) == attempt:
            del self.owed[rollout]  # in flight now: the scope names it from in_flight
        self.done_events[rollout] = anyio.Event()
        self.refused_events[rollout] = anyio.Event()
        try:
            await self.log({"event": "dispatch", "rollout": rollout, "attempt": attempt})
            body = {
                "episode_id": episode.model_dump(),
                "task": task_of(rollout, self.plan.task_input),
            }
            url = self.environment_url(rollout) + "/run"
            pause = FIRST_PAUSE_S
            while True:
                refused = self.refused_events[rollout] = anyio.Event()
                try:
                    reply = await self.http.post(url, json=body)
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    # The request never reached the server, so nothing runs: the same attempt
                    # is sent again, after a pause, as for a closed admission (D372).
                    refused.set()
                    await anyio.sleep(jittered(pause))
                    pause = next_pause(pause)
                    continue
                code = error_code(reply)
                if code == "admission_closed":
                    refused.set()  # not running anywhere: a commit need not wait for it
                    if self.admission.is_open:
                        await anyio.sleep(jittered(pause))  # same attempt after the resume
                        pause = next_pause(pause)
                    else:
                        # Closed by this controller's own checkpoint: after its resume (D402).
                        await self.admission.wait_open(REOPEN_WAIT_S)
                        await anyio.sleep(jittered(LAST_PAUSE_S))
                    continue
                break
            if reply.status_code != 200 or "result" not in reply.json():
                failure = reply.json().get("failure") if reply.status_code == 200 else None
                await self.log(
                    {
                        "event": "run_failed",
                        "rollout": rollout,
                        "attempt": attempt,
                        "status": reply.status_code,
                        "code": code,
                        "detail": error_detail(reply),
                        "failure": failure,  # the episode's own failure (a 200 without result)
                    }
                )
                return
            result = reply.json()["result"]
            # A retire waits for an episode in its final clean-up and lets its result through
            # (control-plane §3.2 retire): an attempt this controller retired meanwhile is
            # dropped, its ledger retired with it, and the rollout reruns as its next attempt.
            if self.retired.get(rollout, -1) >= attempt:
                await self.discard(episode, "retired while its reply was on the wire")
                return
            self.settling[rollout] = attempt  # no retire or forced block picks it from now on
            manifest = await self.control.ledger_manifest(episode.capture_key)
            if manifest is None:
                await self.discard(episode, "its ledger was retired before the manifest was read")
                return
            await self.log(
                {
                    "event": "result",
                    "rollout": rollout,
                    "attempt": attempt,
                    "reward": result["reward"],
                    "manifest": manifest,
                }
            )
            self.state.accepted[rollout] = {"attempt": attempt, "reward": result["reward"]}
            self.say_progress()
        finally:
            if self.settling.get(rollout) == attempt:
                del self.settling[rollout]
            if self.in_flight.get(rollout) == attempt:
                del self.in_flight[rollout]
            self.done_events[rollout].set()
            self.wake.set()

    async def finished_or_refused(self, rollout: str) -> None:
        """Wait until the rollout's attempt ends or its ``/run`` is refused at the closed
        admission. A rollout left out of an export either finished (its reply is on the wire)
        or never started: with hundreds in flight, some were dispatched while the checkpoint
        held admission closed, and they finish only after the resume this commit precedes."""
        done, refused = self.done_events[rollout], self.refused_events[rollout]
        async with anyio.create_task_group() as group:

            async def first(event: anyio.Event) -> None:
                await event.wait()
                group.cancel_scope.cancel()

            group.start_soon(first, done)
            group.start_soon(first, refused)

    async def discard(self, episode: EpisodeId, why: str) -> None:
        """Log that a result of ``episode`` was not accepted, and why."""
        await self.log(
            {
                "event": "run_discarded",
                "rollout": episode.rollout_id,
                "attempt": episode.attempt,
                "why": why,
            }
        )

    def retirable(self) -> list[tuple[str, int]]:
        """In-flight and owed attempts a retire may pick: not one whose result is being accepted."""
        attempts = {**self.owed, **self.in_flight}
        return sorted((r, a) for r, a in attempts.items() if self.settling.get(r) != a)

    def environment_url(self, rollout: str) -> str:
        """The environment that runs ``rollout``: the restart-only share has its own."""
        if rollout in self.plan.restart_only_rollouts:
            for server in self.cluster.servers:
                if server.name == self.plan.restart_environment:
                    return server.url
            raise LookupError(f"the cluster file lists no {self.plan.restart_environment}")
        return self.cluster.url_of("environment")

    # ------------------------------------------------------------------ checkpoint
    def finished(self) -> bool:
        """Whether every rollout of the plan has an accepted result."""
        return all(rollout in self.state.accepted for rollout in self.plan.rollouts)

    async def wait_until_filled(self) -> None:
        """Wait (at most ``FILL_WAIT_S``) until the dispatcher has as many rollouts in flight as
        the run carries at once, or has sent them all: a phase's checkpoints come after that, so
        a drill of thousands at once checkpoints thousands in flight (D403)."""
        with anyio.move_on_after(FILL_WAIT_S):
            await self.filled.wait()

    async def wait_for_model_calls_in_flight(self) -> bool:
        """Wait (bounded) until the policy server is generating; False when everything finished."""
        with anyio.move_on_after(60.0):
            while not self.finished():
                if await self.control.model_calls_in_flight() > 0:
                    return True
                await anyio.sleep(0.01)
        return False
