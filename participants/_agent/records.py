"""An agent's checkpoint records: one per session, at its latest boundary, and back again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from protocols import EpisodeId, InvalidCheckpointStateError

from .._runtime.participant import Record
from .._runtime.restore_batch import RestoreScope, validate_batch
from .hooks import RestoredAgentSession
from .session import AGENT_SESSION_STATES, AgentSession


def session_records(sessions: Sequence[AgentSession], states: Mapping[str, Any]) -> list[Record]:
    """The records of ``sessions``, each with the state the export hook gave it."""
    records: list[Record] = []
    for session in sessions:
        assert session.snapshot is not None  # every constructor records one
        key = session.episode_id.capture_key
        records.append(
            {
                "episode_id": session.episode_id.model_dump(),
                "session_key": key,
                "session": states[key],
                "boundary": session.snapshot.boundary(),
            }
        )
    return records


def restored_sessions(
    records: Sequence[Record], scope: Sequence[EpisodeId]
) -> dict[str, RestoredAgentSession]:
    """Every record validated, keyed by its session's next attempt; nothing partial.

    Raises:
        InvalidCheckpointStateError: A record is malformed, or a session is recorded twice.
    """
    indexed = RestoreScope.of(scope)
    sources: list[EpisodeId] = []
    for index, record in enumerate(records):
        try:
            source = indexed.episode(record.get("episode_id"))
        except (ValidationError, AttributeError) as exc:
            raise InvalidCheckpointStateError(
                f"agent record {index} is invalid: {str(exc)[:500]}"
            ) from exc
        if record.get("session_key") != source.capture_key:
            raise InvalidCheckpointStateError(
                f"agent record {index}: session_key does not match {source.capture_key}"
            )
        sources.append(source)
    # Every session state in one validation call (D265); the first bad one is named.
    states = validate_batch(
        AGENT_SESSION_STATES, [record.get("session") for record in records], "agent record"
    )
    restored: dict[str, RestoredAgentSession] = {}
    for source, state in zip(sources, states, strict=True):
        key = indexed.next_key(source)
        if key in restored:
            raise InvalidCheckpointStateError(f"{source.capture_key} is recorded twice")
        restored[key] = RestoredAgentSession(key, indexed.next_attempt(source), state)
    return restored
