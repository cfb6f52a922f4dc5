"""The participant interface: what the control-plane runtime needs from each kind of server.

The runtime owns phases, lease, replay, storage and retire marks; a participant owns its live
work. The runtime reaches the participant only through :class:`Participant`, so a server with
several processes puts a fan-out (:class:`~participants.ProcessFanout`) behind it without
touching the runtime.
:class:`BaseParticipant` gives every optional hook its neutral default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio

from protocols import CheckpointRequest, EpisodeId, ParticipantKind, PrepareReport

from .marks import RetireMarks

Record = dict[str, Any]
"""One exported record: a JSON object whose ``episode_id`` names the attempt it belongs to."""


class ChangeNotifier:
    """Wakes a waiting prepare whenever the participant's readiness may have changed.

    ``version`` counts notifications, so a waiter that read it before checking readiness never
    misses a change that happened in between.
    """

    def __init__(self) -> None:
        self.version = 0
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        """Something changed: wake every waiter."""
        self.version += 1
        # The event is made by the first waiter: a model call notifies four times, nearly
        # always with nobody waiting, and making an event each time was most of the cost (D261).
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait_past(self, version: int) -> None:
        """Return once a notification newer than ``version`` has happened."""
        while self.version == version:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, re-checking it at every notification.

        No deadline of its own: the caller bounds it (the runtime runs retire under the request's
        deadline).
        """
        while True:
            seen = self.version
            if condition():
                return
            await self.wait_past(seen)


@runtime_checkable
class Participant(Protocol):
    """One server's checkpointable state, as the runtime sees it (control-plane §4.0)."""

    kind: ParticipantKind
    instance: str
    changes: ChangeNotifier

    def attach(self, marks: RetireMarks) -> None:
        """Receive the runtime's retire marks, which the data plane checks on every request."""
        ...

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Stop admitting new work; in-flight work parks at its next boundary."""
        ...

    async def open_admission(self) -> None:
        """Admit work again; parked work continues and held responses are delivered."""
        ...

    def readiness(self) -> PrepareReport:
        """What blocks a safe cut now (the runtime caps the listed blockers)."""
        ...

    def ready(self) -> bool:
        """Cheap check of ``readiness().ready``, polled on every change."""
        ...

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Frozen records of the parked work in scope (all of it for a null scope)."""
        ...

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Validate every record, then install each under its next attempt, or change nothing."""
        ...

    def served_live_work(self) -> bool:
        """Whether this process has served live work (a restore then is refused)."""
        ...

    def restored_pending(self) -> list[EpisodeId]:
        """Replacement attempts restored here that have not started yet."""
        ...

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Free restored state of ``episode_id`` without refusing the attempt."""
        ...

    async def retire(self, episode_id: EpisodeId) -> None:
        """Stop ``episode_id`` and every earlier attempt, wait until stopped, then free them."""
        ...

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """``retire`` of every one of ``episode_ids``: what one retire request asks (D389).

        A participant whose retire does I/O (a ledger's fsync, a round trip to another process)
        pays it once for the batch here; one that is only memory can leave the default.
        """
        ...

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        """The marks of these attempts were raised (propagate to shard processes if any)."""
        ...

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        """The marks of these rollouts are about to go; refuse if retired state is not freed."""
        ...

    async def park_exported(self, records: Sequence[Record]) -> None:
        """After a durable commit with ``stop``: free compute the exported state holds."""
        ...

    def commit_reply(self, records: Sequence[Record]) -> dict[str, Any]:
        """Extra fields of the commit reply."""
        ...

    def manifest_extra(self) -> dict[str, Any]:
        """Extra fields of this participant's manifest."""
        ...

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        """See the manifest being restored, before ``install``."""
        ...

    def status_extra(self) -> dict[str, Any]:
        """Extra fields of the status reply."""
        ...


class BaseParticipant:
    """Neutral defaults for every hook a participant may leave alone.

    Subclasses set ``kind`` and ``instance`` and implement admission, readiness, export, install,
    ``served_live_work`` and ``retire``.
    """

    kind: ParticipantKind
    instance: str

    def __init__(self) -> None:
        self.changes = ChangeNotifier()
        self.marks = RetireMarks()

    def attach(self, marks: RetireMarks) -> None:
        """Share the runtime's retire marks."""
        self.marks = marks

    def ready(self) -> bool:
        """Derived from the full readiness report; override when that is expensive."""
        return self.readiness().ready

    def readiness(self) -> PrepareReport:
        """Override: what blocks a safe cut now."""
        raise NotImplementedError

    def restored_pending(self) -> list[EpisodeId]:
        """No restored state by default."""
        return []

    async def retire(self, episode_id: EpisodeId) -> None:
        """Override: stop and free ``episode_id`` and earlier attempts."""
        raise NotImplementedError

    async def retire_many(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Each in turn, in the request's order."""
        for episode_id in episode_ids:
            await self.retire(episode_id)

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Falls back to retire, which also frees restored state."""
        await self.retire(episode_id)

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        """Nothing to propagate in a single-process server."""

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        """Nothing to check by default."""

    async def park_exported(self, records: Sequence[Record]) -> None:
        """Nothing held outside the process by default."""

    def commit_reply(self, records: Sequence[Record]) -> dict[str, Any]:
        """No extra reply fields by default."""
        return {}

    def manifest_extra(self) -> dict[str, Any]:
        """No extra manifest fields by default."""
        return {}

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        """Nothing to read from the manifest by default."""

    def status_extra(self) -> dict[str, Any]:
        """No extra status fields by default."""
        return {}
