"""A participant for runtime tests: episodes whose steps the test starts and ends by hand."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from participants import BaseParticipant, Record, build_report
from protocols import (
    AdmissionClosedError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    ParticipantKind,
    PrepareReport,
)


@dataclass
class FakeEpisode:
    episode: EpisodeId
    step: int = 0
    in_step: bool = False


class FakeParticipant(BaseParticipant):
    """Episodes that block prepare while a step runs; every export differs from the last."""

    kind: ParticipantKind = "environment"
    instance = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.admission_open = True
        self.episodes: dict[str, FakeEpisode] = {}
        self.restored: dict[str, Record] = {}
        self.served = False
        self.export_calls = 0
        self.close_calls = 0
        self.exports: list[list[Record]] = []
        self.fail_close: Exception | None = None
        self.fail_install: Exception | None = None
        self.export_gate: anyio.Event | None = None
        self.delete_gate: anyio.Event | None = None
        self.installed: list[list[Record]] = []
        self.restarts: set[str] = set()

    # data plane, as a test drives it
    def start(self, episode: EpisodeId) -> None:
        self.marks.check(episode)
        if not self.admission_open and episode.capture_key not in self.restored:
            raise AdmissionClosedError("closed")
        self.served = True
        restored = self.restored.pop(episode.capture_key, None)
        step = 0 if restored is None else int(restored["step"])
        self.episodes[episode.capture_key] = FakeEpisode(episode, step=step)
        self.changes.notify()

    def begin_step(self, key: str) -> None:
        self.episodes[key].in_step = True
        self.changes.notify()

    def end_step(self, key: str) -> None:
        episode = self.episodes[key]
        episode.in_step = False
        episode.step += 1
        self.changes.notify()

    # participant interface
    async def close_admission(self, request: CheckpointRequest) -> None:
        self.close_calls += 1
        if self.fail_close is not None:
            raise self.fail_close
        self.admission_open = False

    async def open_admission(self) -> None:
        self.admission_open = True

    def readiness(self) -> PrepareReport:
        blockers = [key for key, e in self.episodes.items() if e.in_step]
        return build_report(
            blockers, counts={"episodes": len(self.episodes)}, restarts=self.restarts
        )

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        self.export_calls += 1
        if self.export_gate is not None:
            await self.export_gate.wait()
        wanted = None if episode_ids is None else {e.capture_key for e in episode_ids}
        records: list[Record] = []
        for key, episode in sorted(self.episodes.items()):
            if (wanted is None or key in wanted) and key not in self.restarts:
                records.append(
                    {
                        "episode_id": episode.episode.model_dump(),
                        "step": episode.step,
                        "export_no": self.export_calls,
                    }
                )
        for key, record in sorted(self.restored.items()):
            if wanted is None or key in wanted:
                records.append(record)
        self.exports.append(records)
        return records

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        if self.fail_install is not None:
            raise self.fail_install
        for record in records:  # validate every record before installing any
            if not isinstance(record.get("step"), int):
                raise CheckpointError(f"record {record.get('episode_id')} has no integer step")
        for record in records:
            episode = EpisodeId.model_validate(record["episode_id"]).next_attempt()
            self.restored[episode.capture_key] = {**record, "episode_id": episode.model_dump()}
        self.installed.append(list(records))

    def served_live_work(self) -> bool:
        return self.served

    def restored_pending(self) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(key) for key in sorted(self.restored)]

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        if self.delete_gate is not None:
            await self.delete_gate.wait()
        self.restored.pop(episode_id.capture_key, None)

    async def retire(self, episode_id: EpisodeId) -> None:
        for key in [k for k, e in self.episodes.items() if episode_id.covers(e.episode)]:
            del self.episodes[key]
        for key in [k for k in self.restored if episode_id.covers(EpisodeId.from_capture_key(k))]:
            del self.restored[key]
        self.changes.notify()

    def status_extra(self) -> dict[str, Any]:
        return {"restored_pending": sorted(self.restored)}


class WindDown:
    """A peer call that never answers and, once cancelled, winds down only when ``released``
    is set, as a real call does while its connection is closed on a busy event loop (D412)."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.released = anyio.Event()

    async def hold(self, key: str) -> None:
        """Wait until cancelled, note ``key``, wait for the release, then re-raise."""
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(key)
            with anyio.CancelScope(shield=True):
                await self.released.wait()
            raise
