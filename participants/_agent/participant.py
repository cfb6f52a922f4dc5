"""The agent participant (kind ``agent``): sessions driven activation by activation.

An environment seeds a session, then invokes its activations one at a time with a 1-based index
(control-plane §4.2, errata §10.1). An activation runs the task's turns: a boundary before each
model call, the model call, the tool call its completion picks, a boundary after the tool round.
While a checkpoint is open a session parks at its next boundary; a model reply that arrives then
is held, so the session stays at the boundary before that call (errata §10.11). Export writes each
session as of its latest boundary; a restore installs it under the next attempt, and the next
activation continues from there: it re-issues the pending model call and never repeats a tool
call the conversation already holds. A harness with state outside the process plugs in through
the batched hooks of ``_agent_hooks``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio

from protocols import (
    ActivationOutOfOrderError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    ParticipantKind,
    PrepareReport,
    StaleAttemptError,
    attempts_through,
    keys_covered_by,
)

from .._runtime.participant import BaseParticipant, Record
from .._runtime.report import build_report
from .hooks import AgentSessionHooks, CounterSessionHooks
from .records import restored_sessions, session_records
from .session import (
    AgentPeers,
    AgentSession,
    AgentTaskInput,
    BoundaryKind,
    choose_tool,
)


class AgentParticipant(BaseParticipant):
    """Counter-episode agent sessions with boundaries before each model call and after each tool.

    Args:
        instance: The server name (a path component of the checkpoint layout).
        peers: How to reach the policy model and the resources server.
        hooks: The harness's batched session hooks (the counter agent's by default).
    """

    kind: ParticipantKind = "agent"

    def __init__(
        self, instance: str, peers: AgentPeers, hooks: AgentSessionHooks | None = None
    ) -> None:
        super().__init__()
        self.instance = instance
        self.peers = peers
        self.hooks: AgentSessionHooks = hooks or CounterSessionHooks()
        self.sessions: dict[str, AgentSession] = {}
        self.accepting = True  # sessions run past their boundaries
        self.seeds_accepting = True  # new seeds are admitted
        self._opened = anyio.Event()
        self._opened.set()
        self._seeds: Counter[str] = Counter()  # seeds past admission, per capture key
        self._seeds_changed = anyio.Event()
        self._served = False

    # ------------------------------------------------------------------ data plane

    async def seed(
        self, episode_id: EpisodeId, resources_session_id: str, task_input: AgentTaskInput
    ) -> str:
        """Open the session of ``episode_id``; a repeat with the same arguments is a no-op.

        Raises:
            StaleAttemptError: The attempt is retired or fenced, or was retired while seeding
                (what the seed built is freed first).
            CheckpointError: The key already holds a session with another task or resources
                session.
        """
        self.marks.check(episode_id)
        # The environment's replay step is still in flight, so its boundary precedes this seed:
        # wait for resume rather than refuse. The lease bounds how long a checkpoint stays open.
        while not self.seeds_accepting:
            await self._opened.wait()
        key = episode_id.capture_key
        self._seeds[key] += 1  # a seed past admission blocks prepare until it is registered
        try:
            self.marks.check(episode_id)  # it may have been retired while waiting
            if self._same_session(key, resources_session_id, task_input):
                return key
            self._served = True
            await self.hooks.open_agent_session(episode_id, task_input, resources_session_id)
            try:
                self.marks.check(episode_id)  # retired while the hook was building
            except StaleAttemptError:
                await self.hooks.retire_agent_session(key)
                raise
            if not self._same_session(key, resources_session_id, task_input):
                self.sessions[key] = AgentSession.seeded(
                    episode_id, task_input, resources_session_id
                )
            return key
        finally:
            self._seeds[key] -= 1
            if not self._seeds[key]:
                del self._seeds[key]
            self._seeds_changed.set()
            self._seeds_changed = anyio.Event()
            self.changes.notify()

    def _same_session(self, key: str, resources_session_id: str, task: AgentTaskInput) -> bool:
        """Whether ``key`` already holds this very session (a repeated seed); refuse another."""
        existing = self.sessions.get(key)
        if existing is None:
            return False
        if existing.resources_session_id != resources_session_id or existing.task_input != task:
            raise CheckpointError(f"{key} is already seeded with another task or session")
        return True

    async def activate(self, episode_id: EpisodeId, index: int) -> dict[str, Any]:
        """Run activation ``index`` (1-based), or repeat the reply of the last completed one.

        Raises:
            StaleAttemptError: The attempt is retired or fenced, or was retired meanwhile.
            ActivationOutOfOrderError: ``index`` is neither the last completed nor the next.
            CheckpointError: No such session, it is closing, or an activation is running.
        """
        self.marks.check(episode_id)
        session = self._session(episode_id)
        if index == session.completed_activation and session.stored_reply is not None:
            return session.stored_reply
        if index != session.completed_activation + 1:
            raise ActivationOutOfOrderError(
                f"{episode_id.capture_key}: activation {index} requested, "
                f"{session.completed_activation} completed"
            )
        if session.state != "idle":
            raise CheckpointError(f"{episode_id.capture_key} already has an active activation")
        self._served = True
        session.restored_pending = False
        session.state = "running"
        session.scope = anyio.CancelScope()
        stopped = session.stopped = anyio.Event()
        finished = False
        try:
            with session.scope:
                await self._run_turns(session)
                finished = True
        finally:
            if not finished:
                session.rewind()
            session.state = "idle"
            session.parked = False
            session.scope = None
            stopped.set()
            self.changes.notify()
        if not finished:  # cancelled by retire or close
            raise StaleAttemptError(f"{episode_id.capture_key} was retired or closed")
        assert session.stored_reply is not None  # set by the last turn
        return session.stored_reply

    async def close(self, episode_id: EpisodeId) -> None:
        """End the session: cancel a running activation once, wait for it, forget the session."""
        self.marks.check(episode_id)
        session = self.sessions.get(episode_id.capture_key)
        if session is None:
            return
        session.closing = True  # a closing session blocks prepare until it is gone
        self.changes.notify()
        await self._stop(session)
        await self.hooks.retire_agent_session(episode_id.capture_key)
        self.sessions.pop(episode_id.capture_key, None)
        self.changes.notify()

    def _session(self, episode_id: EpisodeId) -> AgentSession:
        session = self.sessions.get(episode_id.capture_key)
        if session is None:
            raise CheckpointError(f"no agent session {episode_id.capture_key}; seed it first")
        if session.closing or session.retired:
            raise CheckpointError(f"agent session {episode_id.capture_key} is closing")
        return session

    async def _run_turns(self, session: AgentSession) -> None:
        task = session.task_input
        key = session.episode_id.capture_key
        while session.turn_in_activation < task.turns:
            await self._boundary(session, "before_model_call")
            # The model holds this reply while a checkpoint is open, so the session cannot move
            # past the boundary meanwhile: it counts as at the boundary, not as running.
            session.state = "at_boundary"
            self.changes.notify()
            if session.held_reply is not None:
                # Restored with the reply the model had already delivered before the checkpoint:
                # asking again would execute a delivered call a second time.
                content, session.held_reply = session.held_reply, None
            else:
                content = await self.peers.complete(
                    key, list(session.conversation), task.max_tokens
                )
                if not self.accepting and session.snapshot is not None:
                    # A reply that arrives while a park is requested is held at the boundary
                    # before its call (errata §10.11); the model counts it delivered, so an
                    # export carries it with that boundary (decision D105).
                    session.snapshot.held_reply = content
            await self._park_while_closed(session)
            session.state = "running"
            self.changes.notify()
            session.conversation.append({"role": "assistant", "content": content})
            tool, arg = choose_tool(content)
            result = await self.peers.call_tool(key, session.resources_session_id, tool, arg)
            session.conversation.append(
                {"role": "tool", "content": f"{tool} {arg} -> {result['value']} {result['notes']}"}
            )
            session.turn_in_activation += 1
            await self._boundary(session, "after_tool_round")
        activation = session.completed_activation + 1
        session.stored_reply = {
            "activation": activation,
            "messages": session.conversation[session.activation_start :],
            "turns": task.turns,
        }
        session.completed_activation = activation
        session.turn_in_activation = 0
        session.record_boundary("between_activations")

    async def _boundary(self, session: AgentSession, kind: BoundaryKind) -> None:
        session.record_boundary(kind)
        await self._park_while_closed(session)
        session.state = "running"

    async def _park_while_closed(self, session: AgentSession) -> None:
        # Stays parked through a new checkpoint that closes before the session wakes. The wait
        # is bounded by the checkpoint's lease: its expiry reopens admission.
        while not self.accepting:
            session.state = "at_boundary"
            session.parked = True
            self.changes.notify()
            await self._opened.wait()
        session.parked = False

    async def _stop(self, session: AgentSession) -> None:
        if session.scope is not None:
            session.scope.cancel()
        if session.stopped is not None:  # an activation has run: wait until it has ended
            await session.stopped.wait()

    # ------------------------------------------------------------------ participant interface

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Every session parks at its next boundary; new seeds wait for resume."""
        self.accepting = False
        self.seeds_accepting = False
        self._opened = anyio.Event()

    async def open_admission(self) -> None:
        """Wake parked sessions, held replies and waiting seeds."""
        self.accepting = True
        self.seeds_accepting = True
        self._opened.set()
        self.changes.notify()

    def _blockers(self) -> list[str]:
        blockers = [
            key
            for key, s in self.sessions.items()
            if s.retired or s.closing or s.state == "running"
        ]
        return blockers + list(self._seeds)

    def readiness(self) -> PrepareReport:
        """Running, closing or retired sessions and seeds in progress block; parked ones don't."""
        at_boundary = sum(s.state == "at_boundary" for s in self.sessions.values())
        return build_report(
            self._blockers(),
            counts={"sessions": len(self.sessions), "at_boundary": at_boundary},
        )

    def ready(self) -> bool:
        """Cheap readiness: nothing blocks."""
        return not self._blockers()

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Every session in scope as of its latest boundary (restored ones as installed).

        The export hook is asked once, for every session at once; this is the only place a
        session's state is built, so rollouts that are never checkpointed pay nothing for it.

        Raises:
            CheckpointError: The hook left a session out (nothing is written).
        """
        wanted = None if episode_ids is None else {e.capture_key for e in episode_ids}
        sessions = [
            session
            for key, session in sorted(self.sessions.items())
            if not session.retired and (wanted is None or key in wanted)
        ]
        if not sessions:
            return []
        states = await self.hooks.export_agent_sessions(sessions)
        missing = [
            s.episode_id.capture_key for s in sessions if s.episode_id.capture_key not in states
        ]
        if missing:
            raise CheckpointError(f"the agent export hook left out sessions {missing[:10]}")
        return session_records(sessions, states)

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Validate every record, then install each under its next attempt, or change nothing.

        Raises:
            CheckpointError: The process already holds sessions or seeds in progress.
            InvalidCheckpointStateError: A record is malformed.
        """
        self._refuse_live_sessions()
        restored = restored_sessions(records, scope)
        await self.hooks.restore_agent_sessions(list(restored.values()))
        self._refuse_live_sessions()  # a seed may have slipped in while the hook ran
        for key, item in restored.items():
            self.sessions[key] = AgentSession.restored(item.episode_id, item.session)
        self.changes.notify()

    def _refuse_live_sessions(self) -> None:
        if self.sessions or self._seeds:
            raise CheckpointError("restore requires a process without live sessions or seeds")

    def served_live_work(self) -> bool:
        """Whether a seed or an activation ran in this process."""
        return self._served

    def restored_pending(self) -> list[EpisodeId]:
        """Restored sessions whose continuation has not started."""
        return [s.episode_id for _, s in sorted(self.sessions.items()) if s.restored_pending]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Drop a restored session that has not continued, without refusing its attempt."""
        session = self.sessions.get(episode_id.capture_key)
        if session is not None and session.restored_pending:
            del self.sessions[episode_id.capture_key]
            self.changes.notify()

    async def retire(self, episode_id: EpisodeId) -> None:
        """``retire_many`` of the one attempt."""
        await self.retire_many([episode_id])

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Stop and free every session of the attempts the batch covers, after their seeds end;
        one pass over the sessions for the whole batch (D389)."""
        # A seed past admission would otherwise register a session right after we freed them.
        while keys_covered_by(self._seeds, episode_ids):
            await self._seeds_changed.wait()
        through = attempts_through(episode_ids)
        covered = [
            s
            for s in self.sessions.values()
            if s.episode_id.attempt <= through.get(s.episode_id.rollout_id, -1)
        ]
        for session in covered:
            session.retired = True  # a blocker until freed, so no checkpoint exports it
            if session.scope is not None:
                # Every one cancelled before any is waited for: they wind down in the same
                # turns of the loop, not one after another (D412).
                session.scope.cancel()
        self.changes.notify()
        for session in covered:
            await self._stop(session)
            await self.hooks.retire_agent_session(session.episode_id.capture_key)
            # Free last: a retire cut short by its deadline leaves the session for the retry.
            self.sessions.pop(session.episode_id.capture_key, None)
        self.changes.notify()

    def status_extra(self) -> dict[str, Any]:
        """Whether sessions are admitted, and which restored sessions still wait."""
        return {
            "accepting": self.accepting,
            "restored_pending": [e.capture_key for e in self.restored_pending()],
        }
