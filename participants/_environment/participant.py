"""The environment participant (kind ``environment``): episodes driven seed → activations → verify.

``EnvironmentParticipant.run`` drives one episode of the reference deployment (e2e-contract §3):
seed the resources session and open the agent session (a replay step), invoke the agent once per
activation (replay steps carrying the activation index), verify in the mode the resources server
announced, and return. A boundary is recorded after every step; while a checkpoint is open the
episode parks there. A checkpoint exports ``{"episode_id", "task_digest", "boundary"}`` per episode;
a restore keeps each record under its replacement attempt until ``run`` continues it from that
boundary. The peers are reached through :class:`EnvironmentPeers`, so the episode logic does not
depend on HTTP. An optional per-episode budget (``episode_seconds``) stops counting while a
checkpoint holds the episode; an episode that runs out of it fails with ``deadline_exceeded``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from protocols import (
    AdmissionClosedError,
    CheckpointError,
    CheckpointRequest,
    DeadlineExceededError,
    EpisodeId,
    ParticipantKind,
    PrepareReport,
    StaleAttemptError,
    WireError,
    keys_covered_by,
    task_digest,
)

from .._runtime.clock import Clock, SystemClock
from .._runtime.participant import BaseParticipant, Record
from .._runtime.report import build_report
from .deadline import EpisodeDeadline
from .models import (
    BOUNDARY_ADAPTER,
    Boundary,
    BoundaryCommon,
    EnvironmentPeers,
    EnvironmentRecord,
    EpisodeOutcome,
    InvokeAgentBoundary,
    ReturnBoundary,
    VerifyBoundary,
    restored_records,
)
from .steps import EpisodeSteps, StepMode, TrackedEpisode

_log = structlog.get_logger("midflight.environment")


class EnvironmentParticipant(BaseParticipant):
    """Environment episodes with boundaries, parking, export and restore (control-plane §4.1).

    Use ``async with participant.serving():`` around serving: the episodes run in its task
    group, so an episode keeps going when the caller of ``run`` goes away.

    Args:
        instance: The server's name.
        peers: The agent and resources servers.
        episode_seconds: Each attempt's time budget, not counting time a checkpoint holds it;
            ``None`` for none.
        clock: Where the budget reads the time.
    """

    kind: ParticipantKind = "environment"

    def __init__(
        self,
        instance: str,
        peers: EnvironmentPeers,
        *,
        episode_seconds: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        if episode_seconds is not None and not episode_seconds > 0:
            raise ValueError(f"episode_seconds must be positive, not {episode_seconds!r}")
        self.instance = instance
        self.peers = peers
        self.episode_seconds = episode_seconds
        self.clock: Clock = clock or SystemClock()
        self.steps = EpisodeSteps(self.changes)
        self.digests: dict[str, str] = {}
        self.restored: dict[str, EnvironmentRecord] = {}
        self.claim_restored: Callable[[str], Awaitable[bool]] | None = None
        """Set by a shard of a server with several processes: asks the fan-out for a restored key."""
        self.awaiting_resume = False
        self.served = False
        self._task_group: TaskGroup | None = None

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[EnvironmentParticipant]:
        """Run episodes for as long as the block lasts; cancel what is left at the end."""
        async with anyio.create_task_group() as group:
            self._task_group = group
            try:
                yield self
            finally:
                self._task_group = None
                group.cancel_scope.cancel()

    # ------------------------------------------------------------------ data plane

    async def run(self, episode_id: EpisodeId, task: dict[str, Any]) -> EpisodeOutcome:
        """Run (or continue, after a restore) one episode and wait for its outcome.

        Raises:
            StaleAttemptError: The attempt is retired or fenced, or was retired while running.
            AdmissionClosedError: A checkpoint is open (a restored replacement is admitted once
                the resume that follows its restore has happened).
            CheckpointError: The restored record was taken for another task, or the key runs.
        """
        await self._claim(episode_id.capture_key)
        episode, continued = self._begin(episode_id, task)
        outcome: list[EpisodeOutcome] = []
        if self._task_group is None:
            raise RuntimeError("the environment is not serving: use `async with serving()`")
        self._task_group.start_soon(self._drive, episode_id, task, episode, continued, outcome)
        await episode.stopped.wait()
        if not outcome:
            raise StaleAttemptError(f"{episode_id.capture_key} was retired while running")
        return outcome[0]

    async def _claim(self, key: str) -> None:
        """With several processes, every shard holds the restored records: one claim wins each.

        While a checkpoint is open the fan-out refuses every claim, so a shard that was told
        refuses here, without a round trip: a controller retrying thousands of restored rollouts
        against a closed admission would otherwise send the fan-out a claim for each (D400).
        """
        if self.claim_restored is None or key not in self.restored:
            return
        if not self.steps.accepting:
            raise AdmissionClosedError("a checkpoint is open; send the same attempt after resume")
        if not await self.claim_restored(key):
            self.restored.pop(key, None)
            self.changes.notify()
            raise CheckpointError(f"{key}: another worker claimed its restored state first")

    def _begin(
        self, episode_id: EpisodeId, task: dict[str, Any]
    ) -> tuple[TrackedEpisode, EnvironmentRecord | None]:
        self.marks.check(episode_id)
        key = episode_id.capture_key
        restored = self.restored.get(key)
        if not self.steps.accepting and (restored is None or self.awaiting_resume):
            raise AdmissionClosedError("a checkpoint is open; send the same attempt after resume")
        digest = task_digest(task)
        if restored is not None and restored.task_digest != digest:
            raise CheckpointError(f"{key} continues a checkpoint recorded for a different task")
        if key in self.steps.episodes:
            raise CheckpointError(f"{key} is already running")
        self.restored.pop(key, None)
        self.served = True
        self.digests[key] = digest
        boundary = None
        if restored is not None and restored.boundary is not None:
            boundary = restored.boundary.model_dump()
        # A replacement attempt gets a whole budget: records carry no time (the format is fixed).
        deadline = None
        if self.episode_seconds is not None:
            deadline = EpisodeDeadline(self.clock, self.episode_seconds)
        return self.steps.begin(key, boundary, deadline), restored

    async def _drive(
        self,
        episode_id: EpisodeId,
        task: dict[str, Any],
        episode: TrackedEpisode,
        restored: EnvironmentRecord | None,
        outcome: list[EpisodeOutcome],
    ) -> None:
        key = episode_id.capture_key
        sessions: list[str] = []
        try:
            with episode.scope:
                failure: Exception | None = None
                work = anyio.CancelScope()
                async with anyio.create_task_group() as watchers:
                    if episode.deadline is not None:
                        watchers.start_soon(episode.deadline.watch, work)
                    with work:
                        try:
                            reward = await self._steps(episode, key, task, restored, sessions)
                            result = {
                                "reward": reward,
                                "model_calls": _calls(task),
                                "tool_calls": _calls(task),
                            }
                            outcome.append(EpisodeOutcome(result=result))
                        except Exception as exc:  # a peer refused or failed: the episode ends
                            failure = exc
                    watchers.cancel_scope.cancel()
                if episode.deadline is not None and episode.deadline.expired:
                    failure = DeadlineExceededError(
                        f"{key} used up its {episode.deadline.seconds:g} s episode deadline "
                        "(time held by checkpoints not counted)"
                    )
                if failure is not None:
                    # No episode finishes while a checkpoint is open: it parks at its last
                    # boundary (None after a failed replay step) and reports after the resume.
                    await self.steps.boundary(episode, episode.boundary)
                    code = failure.code if isinstance(failure, WireError) else "internal_error"
                    # Some errors (a bare timeout) say nothing: the detail then names the type.
                    detail = str(failure) or repr(failure)
                    outcome.append(EpisodeOutcome(failure={"code": code, "detail": detail}))
                self.steps.finishing(episode)
                await self._close_quietly(key, sessions[0] if sessions else None)
        finally:
            self.digests.pop(key, None)
            self.steps.end(episode)

    async def _steps(
        self,
        episode: TrackedEpisode,
        key: str,
        task: dict[str, Any],
        restored: EnvironmentRecord | None,
        sessions: list[str],
    ) -> float:
        # ``sessions`` receives the resources session id as soon as it is known, for clean-up.
        if restored is not None and restored.boundary is not None:
            sessions.append(restored.boundary.resources_session_id)
            await self.steps.boundary(episode, episode.boundary)  # parks if closed
        else:
            sessions.append(await self._seed(episode, key, task))
        return await self._advance(episode, key, task)

    async def _seed(self, episode: TrackedEpisode, key: str, task: dict[str, Any]) -> str:
        task_input = task["task_input"]
        async with self.steps.step(episode, "replay"):
            seeded = await self.peers.seed_resources(key, task_input)
            if seeded.restart:
                await self.steps.mark_restart(episode)
            await self.peers.seed_agent(key, seeded.session_id, task_input)
        first: Boundary
        if int(task_input["activations"]) >= 1:
            first = InvokeAgentBoundary(
                next="invoke_agent",
                activation=1,
                resources_session_id=seeded.session_id,
                verify=seeded.verify,
            )
        else:
            first = VerifyBoundary(
                next="verify", resources_session_id=seeded.session_id, verify=seeded.verify
            )
        await self.steps.boundary(episode, first.model_dump())
        return seeded.session_id

    async def _advance(self, episode: TrackedEpisode, key: str, task: dict[str, Any]) -> float:
        activations = int(task["task_input"]["activations"])
        while True:
            boundary = BOUNDARY_ADAPTER.validate_python(episode.boundary)
            following: Boundary
            common: BoundaryCommon = {
                "resources_session_id": boundary.resources_session_id,
                "verify": boundary.verify,
            }
            if isinstance(boundary, ReturnBoundary):
                return boundary.reward
            if isinstance(boundary, InvokeAgentBoundary):
                async with self.steps.step(episode, "replay"):
                    await self.peers.activate(key, boundary.activation)
                if boundary.activation < activations:
                    following = InvokeAgentBoundary(
                        next="invoke_agent", activation=boundary.activation + 1, **common
                    )
                else:
                    following = VerifyBoundary(next="verify", **common)
            else:
                mode: StepMode = boundary.verify
                async with self.steps.step(episode, mode):
                    reward = await self.peers.verify(key, boundary.resources_session_id)
                following = ReturnBoundary(next="return", reward=reward, **common)
            await self.steps.boundary(episode, following.model_dump())

    async def _close_quietly(self, key: str, session_id: str | None) -> None:
        # Clean-up only: a refusal (say, the peer already freed the session) changes nothing.
        try:
            await self.peers.close(key, session_id)
        except Exception as exc:  # the peers free sessions on retire too
            _log.warning("episode_close_failed", episode=key, error=repr(exc)[:300])

    # ------------------------------------------------------------------ participant interface

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Close admission: new ``/run``s are refused, episodes park at their next boundary."""
        self.steps.close()

    async def open_admission(self) -> None:
        """Reopen: parked episodes continue, and restored replacements are admitted."""
        self.awaiting_resume = False
        self.steps.open()

    def readiness(self) -> PrepareReport:
        """Blockers: retired episodes still stopping, and episodes running or in a wait step."""
        return build_report(
            self.steps.blockers(),
            counts={"episodes": len(self.steps.episodes)},
            restarts=self.steps.restarts(),
        )

    def ready(self) -> bool:
        """Whether nothing blocks a safe cut."""
        return not any(episode.blocks for episode in self.steps.episodes.values())

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Parked and replay-step episodes, then restored records whose replacement is in scope."""
        wanted = None if episode_ids is None else {e.capture_key: e for e in episode_ids}
        records: list[Record] = []
        for key, episode in sorted(self.steps.episodes.items()):
            if episode.exportable and (wanted is None or key in wanted):
                # A scoped key's attempt is the scope's own, validated already (D425).
                named = EpisodeId.from_capture_key(key) if wanted is None else wanted[key]
                records.append(
                    {
                        "episode_id": {"rollout_id": named.rollout_id, "attempt": named.attempt},
                        "task_digest": self.digests[key],
                        "boundary": episode.boundary,
                    }
                )
        for key, record in sorted(self.restored.items()):
            if wanted is None or key in wanted:
                records.append(record.model_dump(mode="json"))
        return records

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Validate every record, then keep each under its replacement attempt.

        Raises:
            CheckpointError: The process has live episodes or restored records.
            InvalidCheckpointStateError: A record is malformed; nothing is installed.
        """
        if self.steps.episodes or self.restored:
            raise CheckpointError("restore requires a process without live episodes")
        self.restored = restored_records(records, scope)
        self.awaiting_resume = True
        self.changes.notify()

    def served_live_work(self) -> bool:
        """Whether any ``run`` was admitted in this process."""
        return self.served

    def restored_pending(self) -> list[EpisodeId]:
        """Replacement attempts restored here and not yet run."""
        return [EpisodeId.from_capture_key(key) for key in sorted(self.restored)]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Drop the restored record of ``episode_id`` (no refusal mark)."""
        self.restored.pop(episode_id.capture_key, None)
        self.changes.notify()

    async def retire(self, episode_id: EpisodeId) -> None:
        """``retire_many`` of the one attempt."""
        await self.retire_many([episode_id])

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Stop every tracked attempt the batch covers, wait, then free it and its records; one
        pass over what is tracked for the whole batch (D389)."""
        tracked = dict(self.steps.episodes)
        covered = keys_covered_by(tracked, episode_ids)
        for key in covered:
            # Every one cancelled before any is waited for: they wind down in the same turns
            # of the loop, not one after another (D412).
            self.steps.halt(tracked[key])
        for key in covered:
            await self.steps.stop(tracked[key])
            self.digests.pop(key, None)
        for key in keys_covered_by(self.restored, episode_ids):
            del self.restored[key]
        self.changes.notify()

    def status_extra(self) -> dict[str, Any]:
        """``restored_pending``: the replacement keys still waiting for their ``run``."""
        return {"restored_pending": sorted(self.restored)}


def _calls(task: dict[str, Any]) -> int:
    task_input = task["task_input"]
    return int(task_input["activations"]) * int(task_input["turns"])
