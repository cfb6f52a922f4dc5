"""A reference controller for tests: the reference's wire models, written afresh, and a client.

Every model is written field for field from the reference documents (control-plane.md §3.2 and §5
with errata 10.12 and 10.13; policy-model-and-ledger.md §2.4, §2.5, §2.11 with errata 7.1), with
extra fields forbidden and no field defaulted on a reply. Nothing is imported from ``protocols``:
an extra or a missing field on the wire fails a test that reads it, as it would for the
reference's own coordination and capture-ledger clients. Only status and commit replies (and a
participant manifest) admit extras, because the reference gives them kind extras (D226).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Literal, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict

from e2e._bench.common import TOKEN, InProcessCluster

Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]
Kind = Literal["environment", "model", "agent", "resources"]
Role = Literal["environment", "model", "agent", "resources"]
CONTROL = "/ng-control/v1/checkpoint"
LEDGER = "/training-token-capture/control"
PREPARE_ORDER: tuple[Role, ...] = ("environment", "model", "agent", "resources")
RETIRE_ORDER: tuple[tuple[Role, ...], ...] = (("environment",), ("agent",), ("model", "resources"))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class WithExtras(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


# ------------------------------------------------------------------ control plane (§5)


class EpisodeId(Strict):
    rollout_id: str
    attempt: int = 0


class CheckpointRequest(Strict):
    checkpoint_id: str
    deadline_ts: float


class CommitRequest(CheckpointRequest):
    checkpoint_dir: str
    episode_ids: list[EpisodeId] | None
    stop: bool = False


class RestoreRequest(CheckpointRequest):
    checkpoint_dir: str
    episode_ids: list[EpisodeId]


class RetireRequest(CheckpointRequest):
    episode_ids: list[EpisodeId]


class ForgetRequest(CheckpointRequest):
    rollout_ids: list[str]


class PrepareReport(Strict):
    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[str]


class StatusReply(WithExtras):  # "...kind extras"
    kind: Kind
    instance: str
    phase: Phase
    checkpoint_id: str | None
    lease_expires_at: float | None
    retired_rollouts: int
    report: PrepareReport


class PrepareReply(Strict):
    phase: Phase
    report: PrepareReport


class ParticipantManifest(WithExtras):  # "...participant extra"
    schema_version: Literal[1]
    kind: Kind
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int


class CommitReply(WithExtras):  # "...participant extras"
    phase: Literal["committed"]
    manifest: ParticipantManifest
    episode_ids: list[str]


class ModelCommitReply(CommitReply):
    staging_keys: list[str]
    staging_keys_by_episode: dict[str, list[str]]


class RestoreReply(Strict):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]


class ResumeReply(Strict):
    phase: Literal["idle"]
    idempotent: bool


class RetireReply(Strict):
    retired: list[str]


class ForgetReply(Strict):
    forgotten: list[str]


class ErrorDetail(Strict):
    code: str
    detail: str


class ErrorEnvelope(Strict):
    error: ErrorDetail


# ------------------------------------------------------------------ capture ledger (§2.5, §2.11)


class CallRecord(Strict):
    schema_version: Literal[2]
    digest_version: Literal[2]
    extras_digest_version: Literal[1]
    model_call_id: str
    parent_call_id: str | None
    staging_key: str
    weight_version: int
    prev_len: int
    delta_len: int
    cum_len: int
    digest: str
    extras_digest: str
    mode: Literal["text", "token_in"]
    admitted_at: float | None
    chain_hash: str
    cumulative_hash: str
    response_id: str
    output_fingerprint: str | None
    continuation_fingerprint: str | None
    fingerprint_version: int


class ManifestFailure(Strict):
    schema_version: int
    model_call_id: str
    reason: str


class RolloutManifest(Strict):
    schema_version: Literal[2]
    rollout_id: str
    records: list[CallRecord]
    failures: list[ManifestFailure]


class LedgerBatchRequest(Strict):
    rollout_ids: list[str]


class RolloutRemoval(Strict):
    removed: list[str]
    absent: list[str]


M = TypeVar("M", bound=BaseModel)


class ReferenceController:
    """A controller that speaks only the models above, over one client per server."""

    def __init__(self, clients: dict[Role, httpx.AsyncClient]) -> None:
        self.clients = clients

    @staticmethod
    def parsed(reply: httpx.Response, model: type[M]) -> M:
        """A 200 reply read strictly as ``model``."""
        assert reply.status_code == 200, (reply.request.url, reply.status_code, reply.text)
        return model.model_validate_json(reply.content)

    async def post(self, role: Role, path: str, body: BaseModel, model: type[M]) -> M:
        """POST ``body`` (every field of it, defaults included) and read the reply as ``model``."""
        reply = await self.clients[role].post(
            path, content=body.model_dump_json(), headers={"content-type": "application/json"}
        )
        return self.parsed(reply, model)

    async def control(self, role: Role, operation: str, body: BaseModel, model: type[M]) -> M:
        """One control operation on the server of ``role``."""
        return await self.post(role, f"{CONTROL}/{operation}", body, model)

    async def status(self, role: Role) -> StatusReply:
        """``GET status`` of one server."""
        return self.parsed(await self.clients[role].get(f"{CONTROL}/status"), StatusReply)

    async def statuses(self) -> dict[Role, StatusReply]:
        """``GET status`` of every participant."""
        return {role: await self.status(role) for role in PREPARE_ORDER}

    async def manifest(self, key: str) -> RolloutManifest:
        """The capture-ledger manifest of one capture key."""
        reply = await self.clients["model"].get(f"{LEDGER}/rollouts/{key}/manifest")
        return self.parsed(reply, RolloutManifest)

    async def ledger(self, operation: str, keys: list[str]) -> RolloutRemoval:
        """Ledger ``retire`` or ``delete`` of ``keys`` (one batch)."""
        body = LedgerBatchRequest(rollout_ids=keys)
        return await self.post("model", f"{LEDGER}/rollouts/{operation}", body, RolloutRemoval)

    async def resume(self, checkpoint_id: str) -> None:
        """Resume every participant in the reverse of ``PREPARE_ORDER``."""
        for role in reversed(PREPARE_ORDER):
            body = CheckpointRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline())
            reply = await self.control(role, "resume", body, ResumeReply)
            assert reply == ResumeReply(phase="idle", idempotent=False)

    async def refused(self, role: Role, method: str, path: str, **kwargs: object) -> ErrorDetail:
        """A request that must be refused; the error of its envelope, read strictly."""
        reply = await self.clients[role].request(method, path, **kwargs)  # type: ignore[arg-type]
        assert reply.status_code >= 400, reply.text
        return ErrorEnvelope.model_validate_json(reply.content).error


def deadline(seconds: float = 60.0) -> float:
    """An absolute deadline ``seconds`` from now."""
    return time.time() + seconds


@asynccontextmanager
async def controller(cluster: InProcessCluster) -> AsyncIterator[ReferenceController]:
    """A reference controller over the apps of ``cluster`` (running)."""
    async with AsyncExitStack() as stack:
        clients: dict[Role, httpx.AsyncClient] = {}
        for role in PREPARE_ORDER:
            clients[role] = await stack.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=cluster.apps[role]),
                    base_url=f"http://{role}",
                    headers={"authorization": f"Bearer {TOKEN}"},
                    timeout=httpx.Timeout(120.0),
                )
            )
        yield ReferenceController(clients)
