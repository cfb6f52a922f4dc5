"""The vocabulary of resources servers: modes, routes, session hooks and session bookkeeping."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from pydantic import ValidationError

from protocols import EpisodeId, InvalidCheckpointStateError

from .._runtime.participant import Record
from .._runtime.restore_batch import RestoreScope

ResourcesMode = Literal["exported", "stateless", "restart_only"]
"""How a server's sessions survive a checkpoint: exported state, nothing needed, or a restart."""
VerifyMode = Literal["wait", "replay"]
"""Whether an open checkpoint waits for ``/verify`` or lets it run (and re-run after a crash)."""
ResourcesRoute = Literal["seed", "tool", "verify", "close"]
"""The lifecycle role of a data request."""

RESOURCES_MODES: Final[tuple[ResourcesMode, ...]] = ("exported", "stateless", "restart_only")
VERIFY_MODES: Final[tuple[VerifyMode, ...]] = ("wait", "replay")
DEFAULT_ADMISSION_WAIT_SECONDS: Final = 900.0
"""How long a request waits for an open checkpoint to resume before it gives up."""


class ResourcesSessionHooks(Protocol):
    """The server's side of session state (batched, async; control-plane §4.3)."""

    async def export_session_states(self, session_ids: Sequence[str]) -> dict[str, Any]:
        """The JSON state of each session; sessions the server no longer holds are omitted."""
        ...

    async def restore_session_states(self, states: Mapping[str, Any]) -> None:
        """Install every state (session id → state), or raise and install none."""
        ...

    async def retire_session_state(self, session_id: str) -> None:
        """Free one session's state; a session already gone is a no-op."""
        ...


@dataclass(eq=False)
class ResourcesSession:
    """What the participant knows of one session.

    Attributes:
        session_id: The id the client sends in its cookie.
        episode_id: The attempt the session belongs to.
        inflight: Counted requests of this session now running.
        restored_pending: Installed by a restore and not yet claimed by a request.
        retired: Refused until freed (a retire collected it).
        end_deferred: A replayable verify ended it while a checkpoint was open.
    """

    session_id: str
    episode_id: EpisodeId
    inflight: int = 0
    restored_pending: bool = False
    retired: bool = False
    end_deferred: bool = False


@dataclass(frozen=True)
class ResourcesAdmission:
    """One admitted request: what the handler may act on."""

    route: ResourcesRoute
    episode_id: EpisodeId | None
    session: ResourcesSession | None
    counted: bool


_SESSION_RECORD_FIELDS: Final = frozenset({"episode_id", "session_id", "state"})


def parse_session_records(
    records: Sequence[Mapping[str, Any]], scope: Sequence[EpisodeId] = ()
) -> tuple[dict[str, EpisodeId], dict[str, Any]]:
    """Validate exported session records: (session id → next attempt, session id → state).

    An ``episode_id`` naming an attempt of ``scope`` (the restore's, validated already) is
    looked up rather than validated again (D264).

    Raises:
        InvalidCheckpointStateError: A record is malformed or two name the same session.
    """
    indexed = RestoreScope.of(scope)
    bound: dict[str, EpisodeId] = {}
    states: dict[str, Any] = {}
    for index, record in enumerate(records):
        session_id = record.get("session_id")
        if record.keys() != _SESSION_RECORD_FIELDS or not isinstance(session_id, str):
            raise InvalidCheckpointStateError(f"record {index} is not a resources session")
        if not session_id or session_id in bound:
            raise InvalidCheckpointStateError(f"record {index}: bad or repeated session id")
        try:
            episode = indexed.episode(record["episode_id"])
        except ValidationError as exc:
            raise InvalidCheckpointStateError(f"record {index}: {exc}") from None
        bound[session_id] = indexed.next_attempt(episode)
        states[session_id] = record["state"]
    return bound, states


def session_records(
    sessions: Sequence[ResourcesSession], states: Mapping[str, Any]
) -> tuple[list[Record], list[str]]:
    """The records of ``sessions`` with their exported states, and the ids the hook left out."""
    records: list[Record] = []
    vanished: list[str] = []
    for session in sessions:
        if session.session_id not in states:
            vanished.append(session.session_id)
            continue
        records.append(
            {
                "episode_id": session.episode_id.model_dump(),
                "session_id": session.session_id,
                "state": states[session.session_id],
            }
        )
    return records, vanished


def unfreed_sessions(sessions: Iterable[ResourcesSession], rollout_ids: Iterable[str]) -> list[str]:
    """Capture keys of retired sessions of ``rollout_ids`` that are not freed yet."""
    wanted = set(rollout_ids)
    return sorted(
        s.episode_id.capture_key
        for s in sessions
        if s.retired and s.episode_id.rollout_id in wanted
    )
