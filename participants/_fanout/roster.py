"""The shards of one server as its main process sees them: who is connected, what they report.

Each close raises the **generation**; a shard's reports carry the generation they answer and a
sequence number, and only the newest report of the current state counts. While admission is
closed the merged report adds ``<kind>-workers-unreported:<n>`` (fewer current reports than
expected shards) and ``<kind>-worker-lost`` (a shard disconnected while closed). Those blocker
names and the ``workers`` count are wire names of the control plane (reference §4.6) and keep
their spelling.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocols import (
    MAX_REPORTED_BLOCKERS,
    CheckpointCoordinatorUnavailableError,
    CheckpointRequest,
    EpisodeId,
    InvalidCheckpointStateError,
    ParticipantKind,
    PrepareReport,
)

from .._runtime.participant import BaseParticipant
from .channel import Channel
from .messages import Readiness, ServerHealth

_log = structlog.get_logger("midflight.fanout")


@dataclass
class ShardState:
    """What the fan-out knows of one connected shard process."""

    pid: int
    slot: int
    channel: Channel
    generation: int = -1
    seq: int = -1
    report: PrepareReport | None = None
    served: bool = False
    restored_pending: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    stopping: bool = False

    def take(self, readiness: Readiness) -> bool:
        """Keep ``readiness`` unless it describes a past state; whether it was kept."""
        # Reports of an older close, or older than the newest we hold, describe a past state.
        if (readiness.generation, readiness.seq) <= (self.generation, self.seq):
            return False
        self.generation, self.seq = readiness.generation, readiness.seq
        self.report = readiness.report
        self.served = readiness.served
        self.restored_pending = list(readiness.restored_pending)
        self.extra = dict(readiness.extra)
        return True


def merge_readiness(
    kind: str,
    shards: Sequence[ShardState],
    *,
    expected: int,
    generation: int,
    closed: bool,
    lost_while_closed: Sequence[int],
) -> PrepareReport:
    """The shards' reports merged, with the blockers of unreported and lost shards."""
    reports = [
        s.report
        for s in shards
        if s.report is not None and (not closed or s.generation == generation)
    ]
    blockers = sorted({b for report in reports for b in report.blockers})
    count = sum(report.blocker_count for report in reports)
    synthetic = []
    if closed:
        missing = expected - len(reports)
        if missing > 0:
            synthetic.append(f"{kind}-workers-unreported:{missing}")
        if lost_while_closed:
            synthetic.append(f"{kind}-worker-lost")
    counts: dict[str, int] = {}
    for report in reports:
        for name, value in report.counts.items():
            counts[name] = counts.get(name, 0) + value
    counts["workers"] = len(shards)
    return PrepareReport(
        ready=count + len(synthetic) == 0,
        blockers=sorted(synthetic + blockers)[:MAX_REPORTED_BLOCKERS],
        blocker_count=count + len(synthetic),
        counts=counts,
        restarts=sorted({r for report in reports for r in report.restarts}),
    )


def merge_status_extra(shards: Iterable[ShardState]) -> dict[str, Any]:
    """The shards' extra status fields: numbers summed, lists merged, the rest first seen."""
    merged: dict[str, Any] = {}
    for shard in sorted(shards, key=lambda s: s.slot):
        for name, value in shard.extra.items():
            if name not in merged:
                merged[name] = value
            elif isinstance(value, list):
                merged[name] = sorted(set(merged[name]) | set(value))
            elif isinstance(value, int) and not isinstance(value, bool):
                merged[name] += value
    return merged


class ShardRoster(BaseParticipant):
    """The connected shards of a server of ``expected`` processes, and their merged state.

    Args:
        kind: The participant kind of the server.
        instance: The server name.
        expected: How many shard processes the server runs.
    """

    def __init__(self, kind: ParticipantKind, instance: str, *, expected: int) -> None:
        super().__init__()
        if expected < 1:
            raise ValueError("a server needs at least one process")
        self.kind = kind
        self.instance = instance
        self.expected = expected
        self.shards: dict[int, ShardState] = {}
        self.generation = 0
        """Raised by every close; a report of an older one describes a past state."""
        self.closed_request: CheckpointRequest | None = None
        self.lost_while_closed: list[int] = []
        self.lost_since_start = 0

    def _join(self, shard: ShardState) -> None:
        self.shards[shard.pid] = shard
        _log.info(
            "shard.joined",
            participant=self.instance,
            pid=shard.pid,
            slot=shard.slot,
            connected=len(self.shards),
            expected=self.expected,
            checkpoint_open=self.closed_request is not None,
        )
        self.changes.notify()

    def _drop(self, shard: ShardState) -> None:
        del self.shards[shard.pid]
        if shard.stopping:
            _log.info("shard.stopped", participant=self.instance, pid=shard.pid, slot=shard.slot)
        else:
            self.lost_since_start += 1
            open_checkpoint = self.closed_request is not None
            if open_checkpoint:
                self.lost_while_closed.append(shard.pid)
            _log.warning(
                "shard.lost",
                participant=self.instance,
                pid=shard.pid,
                slot=shard.slot,
                remaining=len(self.shards),
                expected=self.expected,
                checkpoint_open=open_checkpoint,
                # Its share of the parked work is gone, so the open checkpoint cannot commit.
                open_checkpoint_can_commit=not open_checkpoint,
            )
        self.changes.notify()

    def _take_report(self, shard: ShardState, readiness: Readiness) -> None:
        if shard.take(readiness):
            self.changes.notify()

    def readiness(self) -> PrepareReport:
        """The shards' reports merged, with the blockers of unreported and lost shards."""
        return merge_readiness(
            self.kind,
            list(self.shards.values()),
            expected=self.expected,
            generation=self.generation,
            closed=self.closed_request is not None,
            lost_while_closed=self.lost_while_closed,
        )

    def ready(self) -> bool:
        """Whether the merged report has no blocker."""
        return self.readiness().ready

    def missing_slots(self) -> list[int]:
        """The slots no connected shard runs (a fresh server's shards join one by one)."""
        slots = {s.slot for s in self.shards.values()}
        return sorted(set(range(self.expected)) - slots)

    def health(self) -> ServerHealth:
        """What ``/healthz`` reports: healthy once every slot has a shard (D244)."""
        missing = self.missing_slots()
        return ServerHealth(
            ready=not missing,
            workers=len(self.shards),
            expected=self.expected,
            missing_slots=missing,
        )

    async def await_every_slot(self, what: str) -> None:
        """Wait, until the open request's deadline, for a shard in every slot.

        A restore right after a fresh start may arrive while the last shards are still joining:
        that is a transient state, so it waits, and at the deadline it is a retryable refusal.

        Raises:
            CheckpointCoordinatorUnavailableError: A slot still has no shard at the deadline.
            InvalidCheckpointStateError: A shard was lost while the checkpoint was open.
        """
        request = self.closed_request
        deadline = request.deadline_ts if request is not None else time.time()
        while missing := self.missing_slots():
            remaining = deadline - time.time()
            if remaining <= 0:
                raise CheckpointCoordinatorUnavailableError(
                    f"{what}: no process runs slot {missing} yet ({len(self.shards)} of "
                    f"{self.expected} joined); retry once every process has joined"
                )
            seen = self.changes.version
            with anyio.move_on_after(min(remaining, 0.5)):
                await self.changes.wait_past(seen)
        self._require_every_shard(what)

    def _require_every_shard(self, what: str) -> None:
        if self.lost_while_closed:
            pids = ", ".join(str(pid) for pid in self.lost_while_closed)
            raise InvalidCheckpointStateError(
                f"{what}: process {pids} was lost while the checkpoint was open; its share is gone"
            )
        missing = self.missing_slots()
        if missing:
            raise InvalidCheckpointStateError(f"{what}: no process runs slot {missing}")

    def served_live_work(self) -> bool:
        """Any shard served, or one was lost since start (what it held is unknown)."""
        return self.lost_since_start > 0 or any(s.served for s in self.shards.values())

    def restored_pending(self) -> list[EpisodeId]:
        """Every shard's restored attempts that have not started."""
        keys = sorted({k for s in self.shards.values() for k in s.restored_pending})
        return [EpisodeId.from_capture_key(key) for key in keys]

    def status_extra(self) -> dict[str, Any]:
        """The shards' extra status fields: numbers summed, lists merged, the rest first seen."""
        return merge_status_extra(self.shards.values())


class RosterMetrics(Collector):
    """The shard processes of a server, as its fan-out sees them, on ``/metrics``.

    ``midflight_shard_processes`` (connected now), ``midflight_shard_processes_expected`` and
    ``midflight_shards_lost_total`` (connections that ended without the shard saying it stops).

    Args:
        roster: The fan-out's roster.
    """

    def __init__(self, roster: ShardRoster) -> None:
        self._roster = roster

    def collect(self) -> Iterator[Metric]:
        """The three families, read from the roster at scrape time."""
        roster = self._roster
        yield GaugeMetricFamily(
            "midflight_shard_processes",
            "Shard processes connected to the fan-out now.",
            value=len(roster.shards),
        )
        yield GaugeMetricFamily(
            "midflight_shard_processes_expected",
            "Shard processes the server runs when whole.",
            value=roster.expected,
        )
        yield CounterMetricFamily(
            "midflight_shards_lost",
            "Shard processes lost (their connection ended unannounced) since the start.",
            value=roster.lost_since_start,
        )
