"""The agent's batched session hooks: what a harness adds at seed, export, restore and retire.

The participant owns the session loop and its position (``AgentSessionState``); a harness that
keeps state outside the process (a sandbox, a browser) plugs in here (control-plane §4.2):

- ``open_agent_session`` runs inside the seed, after admission: it may take time (starting a
  sandbox), and while it runs the seed blocks prepare;
- ``export_agent_sessions`` runs once per commit, for every session in scope at once, while
  every one of them is parked; it must describe each session as of its latest boundary;
- ``restore_agent_sessions`` runs once per restore with every restored session, before any is
  registered; if it raises, nothing is installed;
- ``retire_agent_session`` frees one session's outside state and must tolerate it being gone.

:class:`CounterSessionHooks` is the reference deployment's: the counter agent keeps nothing outside
the process, so export returns each session's own state and the rest do nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from protocols import EpisodeId

from .session import AgentSession, AgentSessionState, AgentTaskInput


@dataclass(frozen=True)
class RestoredAgentSession:
    """One session a restore installs: its key and attempt (the next one) and its checked state."""

    session_key: str
    episode_id: EpisodeId
    session: AgentSessionState


class AgentSessionHooks(Protocol):
    """Batched hooks of an agent harness (every method is awaited by the participant)."""

    async def open_agent_session(
        self, episode_id: EpisodeId, task_input: AgentTaskInput, resources_session_id: str
    ) -> None:
        """Build what the session needs outside the process; called once per new session."""
        ...

    async def export_agent_sessions(
        self, sessions: Sequence[AgentSession]
    ) -> Mapping[str, dict[str, Any]]:
        """Session key → the ``session`` object to export, for every session given."""
        ...

    async def restore_agent_sessions(self, restored: Sequence[RestoredAgentSession]) -> None:
        """Rebuild every restored session's outside state, or raise and change nothing."""
        ...

    async def retire_agent_session(self, session_key: str) -> None:
        """Free one session's outside state; a session already freed is not an error."""
        ...


class CounterSessionHooks:
    """The counter agent's hooks: all of its state is the session's own."""

    async def open_agent_session(
        self, episode_id: EpisodeId, task_input: AgentTaskInput, resources_session_id: str
    ) -> None:
        """Nothing to build."""

    async def export_agent_sessions(
        self, sessions: Sequence[AgentSession]
    ) -> Mapping[str, dict[str, Any]]:
        """Each session's state as of its latest boundary."""
        return {s.episode_id.capture_key: s.export_state() for s in sessions}

    async def restore_agent_sessions(self, restored: Sequence[RestoredAgentSession]) -> None:
        """Nothing outside the process to rebuild."""

    async def retire_agent_session(self, session_key: str) -> None:
        """Nothing to free."""
