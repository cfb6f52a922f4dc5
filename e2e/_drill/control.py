"""The drill controller's view of the control plane: the coordinator, plus the few reads it needs.

Everything that changes participant state goes through ``coordinator`` (fixed orders, retries,
publication); this module adds the drill's reads: the model's in-flight calls, ledger manifests,
the published LATEST checkpoint, and what is left over at the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from coordinator import (
    Coordinator,
    HttpClient,
    LedgerClient,
    PrepareResult,
    checkpoint_location,
    discover,
    http_transport,
    publish_checkpoint,
    read_latest,
    send_while_out_of_time,
)
from coordinator.testing import PUBLISH_FAULTS
from participants import live_ledger_keys
from participants.testing import KillPoint
from protocols import (
    CONTROL_PREFIX,
    CommitReply,
    EpisodeId,
    RolloutRetiredError,
)

from .._servers.cluster import PARTICIPANT_ROLES, Cluster
from .._servers.peer_pool import CONTROLLER_POOL
from .store import ModelShareFigures, model_share_figures

OPERATION_SECONDS = 30.0
OUT_OF_TIME_SENDS = 3
"""Most times the controller sends one commit or retire that servers refused for time alone
(``deadline_exceeded``, retryable with the same id; D388, D390)."""


@dataclass(frozen=True)
class CommitOutcome:
    """Every participant's commit reply."""

    replies: Mapping[str, CommitReply]
    kinds: Mapping[str, str]

    def environment_episode_ids(self) -> list[str]:
        """The environment's exported set: the authoritative continued episodes."""
        return sorted(
            key
            for name, reply in self.replies.items()
            if self.kinds[name] == "environment"
            for key in reply.episode_ids
        )

    def generation_cut_episodes(self) -> list[str]:
        """Episodes whose committed model record carries a generation cut (D155)."""
        return sorted(
            str(key)
            for name, reply in self.replies.items()
            if self.kinds[name] == "model"
            for key in (reply.model_extra or {}).get("generation_cut_episodes", ())
        )


class ControlSession:
    """Control of one cluster by one controller incarnation.

    The controller's named kill point (``controller:<boundary>``, test flag only) and a
    publication fault (``MIDFLIGHT_FAULT=latest-before-manifest``) are read from the environment.
    """

    def __init__(self, cluster: Cluster, token: str) -> None:
        self.cluster = cluster
        self.token = token
        self.kill_point = KillPoint("controller")
        fault = os.environ.get("MIDFLIGHT_FAULT")
        self.publish_fault = fault if fault in PUBLISH_FAULTS else None
        self._auth = {"Authorization": f"Bearer {token}"}
        self._http = HttpClient(
            timeout=httpx.Timeout(60.0, connect=10.0), transport=http_transport(CONTROLLER_POOL)
        )
        self._coordinator: Coordinator | None = None
        self._ledger: LedgerClient | None = None

    async def aclose(self) -> None:
        """Close every connection this session opened: the coordinator's, the ledger client's
        and its own reads'."""
        if self._coordinator is not None:
            await self._coordinator.aclose()
        if self._ledger is not None:
            await self._ledger.aclose()
        await self._http.aclose()

    async def coordinator(self) -> Coordinator:
        """The coordinator over every participant of the cluster (discovered once)."""
        if self._coordinator is None:
            urls = [s.url for s in self.cluster.servers if s.role in PARTICIPANT_ROLES]
            self._coordinator = Coordinator(
                await discover(urls, token=self.token), on_boundary=self.kill_point.areach
            )
        return self._coordinator

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareResult:
        """Prepare in the fixed order."""
        return await (await self.coordinator()).prepare(checkpoint_id, deadline)

    async def commit(
        self, checkpoint_id: str, deadline: float, directory: str, episodes: Sequence[EpisodeId]
    ) -> CommitOutcome:
        """Commit the scope on every participant."""
        coordinator = await self.coordinator()
        replies = await coordinator.commit(checkpoint_id, deadline, str(directory), episodes)
        return CommitOutcome(replies, {m.instance: m.kind for m in coordinator.members})

    async def resume(self, checkpoint_id: str, deadline: float) -> None:
        """Resume in the reverse order; one every refusing server refused for time alone is
        sent again with a window as long as the first, as a retire is. A resume is idempotent:
        a server already resumed answers from its record (D395)."""
        coordinator = await self.coordinator()
        await send_while_out_of_time(
            lambda deadline: coordinator.resume(checkpoint_id, deadline),
            deadline,
            seconds=max(deadline - time.time(), 1.0),
            sends=OUT_OF_TIME_SENDS,
        )

    async def restore(
        self, checkpoint_id: str, deadline: float, directory: str, episodes: Sequence[EpisodeId]
    ) -> list[str]:
        """Restore everywhere (all or nothing); the environment's restored keys."""
        coordinator = await self.coordinator()
        replies = await coordinator.restore(checkpoint_id, deadline, str(directory), episodes)
        kinds = {m.instance: m.kind for m in coordinator.members}
        return sorted(
            key for name, r in replies.items() if kinds[name] == "environment" for key in r.restored
        )

    async def retire(self, checkpoint_id: str, episodes: Sequence[EpisodeId]) -> None:
        """Retire in RETIRE_ORDER; a retire every refusing server refused for time alone is sent
        again with a fresh deadline, at most ``OUT_OF_TIME_SENDS`` times in all. A retire is
        idempotent, and what one cut short left running stays tracked for the next (D390)."""
        coordinator = await self.coordinator()
        await send_while_out_of_time(
            lambda deadline: coordinator.retire(checkpoint_id, deadline, episodes),
            time.time() + OPERATION_SECONDS,
            seconds=OPERATION_SECONDS,
            sends=OUT_OF_TIME_SENDS,
        )

    async def forget(self, checkpoint_id: str, rollout_ids: Sequence[str]) -> None:
        """Forget in RETIRE_ORDER."""
        deadline = time.time() + OPERATION_SECONDS
        await (await self.coordinator()).forget(checkpoint_id, deadline, rollout_ids)

    async def publish(
        self,
        root: Path | str,
        checkpoint_id: str,
        commit: CommitOutcome,
        continued: Sequence[EpisodeId],
        controller_state: dict[str, Any],
        traceparent: str | None = None,
    ) -> None:
        """Publish ``checkpoint.json`` (the checkpoint's trace with it) then ``LATEST``."""
        coordinator = await self.coordinator()
        await publish_checkpoint(
            root,
            checkpoint_id,
            coordinator.members,
            commit.replies,
            continued,
            controller_state,
            fault=self.publish_fault,
            on_boundary=self.kill_point.reach,
            traceparent=traceparent,
        )

    @staticmethod
    async def share_figures(checkpoint_dir: Path | str) -> ModelShareFigures:
        """A committed checkpoint's cut tokens and delivered calls, read from the store once."""
        return await anyio.to_thread.run_sync(model_share_figures, checkpoint_dir)

    @staticmethod
    def checkpoint_dir(root: Path | str, checkpoint_id: str) -> str:
        """Where a checkpoint of this run is committed: a directory, or an ``s3://`` URL."""
        return checkpoint_location(root, checkpoint_id)

    async def _get(self, url: str) -> httpx.Response:
        """GET ``url``, sent again (up to three times in all) when the transport lost it: a read
        is idempotent, as the coordinator's clients retry theirs (D371)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(httpx.TransportError),
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._http.get(url, headers=self._auth)
        raise AssertionError("unreachable: the last attempt returned or raised")

    async def _status(self, url: str) -> dict[str, Any]:
        reply = await self._get(url + f"{CONTROL_PREFIX}/status")
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    async def model_calls_in_flight(self) -> int:
        """Model calls admitted and not yet delivered, by the model server's status."""
        status = await self._status(self.cluster.url_of("model"))
        counts = status["report"]["counts"]
        return int(counts.get("inflight", 0))

    async def ledger_manifest(self, capture_key: str) -> dict[str, Any] | None:
        """The capture-ledger manifest of one attempt, as JSON; ``None`` once its ledger is
        retired (410).

        Read through :class:`coordinator.LedgerClient`, the client a training controller uses:
        the manifest is parsed by the wire model, which forbids extra fields, so every drill
        also checks its shape; a lost read is sent again, as the client does for every
        idempotent call.
        """
        if self._ledger is None:
            self._ledger = LedgerClient(
                self.cluster.url_of("model"), capture_token=self.token, request_timeout_s=60.0
            )
        try:
            manifest = await self._ledger.manifest(capture_key)
        except RolloutRetiredError:
            return None
        return manifest.model_dump(mode="json")

    async def leftover(self, root: Path) -> dict[str, int]:
        """What is still alive at the end: phases, marks, fences, live work, finished ledgers."""
        left: dict[str, int] = {}
        for role in PARTICIPANT_ROLES:
            for server in self.cluster.by_role(role):
                status = await self._status(server.url)
                counts = status["report"]["counts"]
                live = sum(
                    int(counts.get(name, 0))
                    for name in ("episodes", "sessions", "inflight", "held")
                )
                left[f"{server.name}.open"] = int(status["phase"] != "idle")
                left[f"{server.name}.retire_marks"] = int(status["retired_rollouts"])
                # Counted apart from retire marks (D223); the final retire and forget end them.
                left[f"{server.name}.restore_fences"] = int(status.get("restore_fences", 0))
                left[f"{server.name}.live"] = live
        left["live_ledgers"] = len(live_ledger_keys(root / "ledger"))  # either layout
        return left

    @staticmethod
    async def read_latest(root: Path | str) -> dict[str, Any]:
        """The checkpoint ``LATEST`` points at, with its directory.

        Raises:
            FileNotFoundError: Nothing was published yet.
        """
        manifest = await anyio.to_thread.run_sync(read_latest, root)
        if manifest is None:
            raise FileNotFoundError(f"no published checkpoint under {root}")
        data: dict[str, Any] = manifest.model_dump(mode="json")
        data["checkpoint_dir"] = checkpoint_location(root, manifest.checkpoint_id)
        return data
