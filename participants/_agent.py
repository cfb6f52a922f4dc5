"""The agent participant (kind ``agent``): sessions driven activation by activation.

An environment seeds a session, then invokes its activations one at a time with a 1-based index
(control-plane §4.2, errata §10.1). An activation runs the task's turns: a boundary before each
model call, the model call, the tool call its completion picks, a boundary after the tool round.
While a checkpoint is open a session parks at its next boundary; a model reply that arrives then
is held, so the session stays at the boundary before that call (errata §10.11). Export writes each
session as of its latest boundary; a restore installs it under the next attempt, and the next
activation continues from there: it re-issues the pending model call and never repeats a tool
call the conversation already holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
from pydantic import ValidationError

from protocols import (
    ActivationOutOfOrderError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    InvalidCheckpointStateError,
    ParticipantKind,
    PrepareReport,
    StaleAttemptError,
)

from ._agent_session import (
    AgentPeers,
    AgentSession,
    AgentSessionState,
    AgentTaskInput,
    BoundaryKind,
    choose_tool,
)
from ._participant import BaseParticipant, Record
from ._report import build_report


class AgentParticipant(BaseParticipant):
    """Counter-episode agent sessions with boundaries before each model call and after each tool.

    Args:
        instance: The server name (a path component of the checkpoint layout).
        peers: How to reach the policy model and the resources server.
    """

    kind: ParticipantKind = "agent"

    def __init__(self, instance: str, peers: AgentPeers) -> None:
        super().__init__()
        self.instance = instance
        self.peers = peers
        self.sessions: dict[str, AgentSession] = {}
        self.accepting = True
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
            StaleAttemptError: The attempt is retired or fenced.
            CheckpointError: The key already holds a session with another task or resources
                session.
        """
        self.marks.check(episode_id)
        # The environment's replay step is still in flight, so its boundary precedes this seed:
        # wait for resume rather than refuse. The lease bounds how long a checkpoint stays open.
        while not self.accepting:
            await self._opened.wait()
        key = episode_id.capture_key
        self._seeds[key] += 1  # a seed past admission blocks prepare until it is registered
        try:
            self.marks.check(episode_id)  # it may have been retired while waiting
            existing = self.sessions.get(key)
            if existing is not None:
                if (
                    existing.resources_session_id != resources_session_id
                    or existing.task_input != task_input
                ):
                    raise CheckpointError(f"{key} is already seeded with another task or session")
                return key
            self._served = True
            self.sessions[key] = AgentSession.seeded(episode_id, task_input, resources_session_id)
            return key
        finally:
            self._seeds[key] -= 1
            if not self._seeds[key]:
                del self._seeds[key]
            self._seeds_changed.set()
            self._seeds_changed = anyio.Event()
            self.changes.notify()

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
        session.stopped = anyio.Event()
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
            session.stopped.set()
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
        await session.stopped.wait()

    # ------------------------------------------------------------------ participant interface

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Every session parks at its next boundary; new seeds wait for resume."""
        self.accepting = False
        self._opened = anyio.Event()

    async def open_admission(self) -> None:
        """Wake parked sessions, held replies and waiting seeds."""
        self.accepting = True
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
        """Every session in scope as of its latest boundary (restored ones as installed)."""
        wanted = None if episode_ids is None else {e.capture_key for e in episode_ids}
        records: list[Record] = []
        for key, session in sorted(self.sessions.items()):
            if session.retired or (wanted is not None and key not in wanted):
                continue
            assert session.snapshot is not None  # every constructor records one
            records.append(
                {
                    "episode_id": session.episode_id.model_dump(),
                    "session_key": key,
                    "session": session.export_state(),
                    "boundary": session.snapshot.boundary(),
                }
            )
        return records

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Validate every record, then install each under its next attempt, or change nothing.

        Raises:
            CheckpointError: The process already holds sessions or seeds in progress.
            InvalidCheckpointStateError: A record is malformed.
        """
        if self.sessions or self._seeds:
            raise CheckpointError("restore requires a process without live sessions or seeds")
        restored: dict[str, AgentSession] = {}
        for index, record in enumerate(records):
            try:
                source = EpisodeId.model_validate(record.get("episode_id"))
                state = AgentSessionState.model_validate(record.get("session"))
            except (ValidationError, AttributeError) as exc:
                raise InvalidCheckpointStateError(
                    f"agent record {index} is invalid: {str(exc)[:500]}"
                ) from exc
            if record.get("session_key") != source.capture_key:
                raise InvalidCheckpointStateError(
                    f"agent record {index}: session_key does not match {source.capture_key}"
                )
            replacement = source.next_attempt()
            if replacement.capture_key in restored:
                raise InvalidCheckpointStateError(f"{source.capture_key} is recorded twice")
            restored[replacement.capture_key] = AgentSession.restored(replacement, state)
        self.sessions.update(restored)
        self.changes.notify()

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
        """Stop and free every session of attempts up to ``episode_id``'s, after its seeds end."""
        # A seed past admission would otherwise register a session right after we freed them.
        while any(episode_id.covers(EpisodeId.from_capture_key(k)) for k in self._seeds):
            await self._seeds_changed.wait()
        covered = [s for s in self.sessions.values() if episode_id.covers(s.episode_id)]
        for session in covered:
            session.retired = True  # a blocker until freed, so no checkpoint exports it
        self.changes.notify()
        for session in covered:
            await self._stop(session)
            # Free last: a retire cut short by its deadline leaves the session for the retry.
            self.sessions.pop(session.episode_id.capture_key, None)
        self.changes.notify()

    def status_extra(self) -> dict[str, Any]:
        """Whether sessions are admitted, and which restored sessions still wait."""
        return {
            "accepting": self.accepting,
            "restored_pending": [e.capture_key for e in self.restored_pending()],
        }
