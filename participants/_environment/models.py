"""The environment's wire records and the peers it drives (control-plane §4.1, e2e-contract §3).

Boundaries name the next step of an episode and carry what continuing there needs (the resources
session and the verify mode, D81); an :class:`EnvironmentRecord` is what a checkpoint stores per
episode; :class:`EnvironmentPeers` is how the episode driver reaches the agent and resources
servers without depending on HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypedDict

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from protocols import EpisodeId, InvalidCheckpointStateError

from .._runtime.restore_batch import RestoreScope, validate_batch

VerifyMode = Literal["wait", "replay"]


class _Boundary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    resources_session_id: str = Field(min_length=1, max_length=200)
    verify: VerifyMode


class InvokeAgentBoundary(_Boundary):
    """Next: activation ``activation`` of the agent session."""

    next: Literal["invoke_agent"]
    activation: int = Field(ge=1)


class VerifyBoundary(_Boundary):
    """Next: verify the resources session."""

    next: Literal["verify"]


class ReturnBoundary(_Boundary):
    """Next: return ``reward``."""

    next: Literal["return"]
    reward: float = Field(strict=False, allow_inf_nan=False)


class BoundaryCommon(TypedDict):
    resources_session_id: str
    verify: VerifyMode


Boundary = Annotated[
    InvokeAgentBoundary | VerifyBoundary | ReturnBoundary, Field(discriminator="next")
]
BOUNDARY_ADAPTER: TypeAdapter[Boundary] = TypeAdapter(Boundary)


class EnvironmentRecord(BaseModel):
    """One exported episode: its attempt, the digest of its task, its latest boundary."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    episode_id: EpisodeId
    task_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    boundary: Boundary | None


ENVIRONMENT_RECORDS: TypeAdapter[list[EnvironmentRecord]] = TypeAdapter(list[EnvironmentRecord])
"""A whole restore's environment records, validated in one call (D265)."""


def restored_records(
    records: Sequence[Mapping[str, Any]], scope: Sequence[EpisodeId]
) -> dict[str, EnvironmentRecord]:
    """Every record validated and moved to its next attempt, keyed by that attempt's capture key.

    A record naming a scoped attempt is validated with the next attempt already in its place,
    so its id is neither validated again nor swapped in by a copy afterwards (D432); any other
    record is validated as it is, and then moved.

    Raises:
        InvalidCheckpointStateError: A record is malformed (``environment record <index> ...``).
    """
    indexed = RestoreScope.of(scope)
    sources = [
        indexed.lookup(record.get("episode_id")) if type(record) is dict else None
        for record in records
    ]
    batch = [
        record if source is None else {**record, "episode_id": indexed.next_attempt(source)}
        for record, source in zip(records, sources, strict=True)
    ]
    try:
        validated = validate_batch(ENVIRONMENT_RECORDS, batch, "environment record")
    except InvalidCheckpointStateError:
        # Refused as read, so that the message shows the record's own episode id.
        validate_batch(ENVIRONMENT_RECORDS, records, "environment record")
        raise
    moved: dict[str, EnvironmentRecord] = {}
    for record, source in zip(validated, sources, strict=True):
        if source is None:
            record = record.model_copy(
                update={"episode_id": indexed.next_attempt(record.episode_id)}
            )
        moved[record.episode_id.capture_key] = record
    return moved


@dataclass(frozen=True)
class SeededSession:
    """What the resources server answered to a seed.

    Attributes:
        session_id: The resources session of the episode.
        verify: The mode the server announced for ``verify``.
        restart: The server cannot capture its part (``x-ng-checkpoint-restart: 1``).
    """

    session_id: str
    verify: VerifyMode
    restart: bool = False


class EnvironmentPeers(Protocol):
    """The agent and resources servers, as the episode driver calls them.

    Every method raises a ``WireError`` for a refusal and any other exception when the peer
    cannot be reached; ``key`` is the capture key of the attempt.
    """

    async def seed_resources(self, key: str, task_input: dict[str, Any]) -> SeededSession:
        """Start the resources session of the episode."""
        ...

    async def seed_agent(
        self, key: str, resources_session_id: str, task_input: dict[str, Any]
    ) -> None:
        """Open the agent session of the episode (session key = ``key``)."""
        ...

    async def activate(self, key: str, activation: int) -> dict[str, Any]:
        """Run activation ``activation`` of the agent session; its reply."""
        ...

    async def verify(self, key: str, resources_session_id: str) -> float:
        """Verify the resources session; the reward."""
        ...

    async def close(self, key: str, resources_session_id: str | None) -> None:
        """Free the episode's agent and resources sessions."""
        ...


@dataclass(frozen=True)
class EpisodeOutcome:
    """How one ``run`` ended: ``result`` or ``failure`` (``{"code", "detail"}``)."""

    result: dict[str, Any] | None = None
    failure: dict[str, str] | None = None
