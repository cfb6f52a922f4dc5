"""The restored copies a claim makes stale, dropped in one message per shard for claims that
come together (D393).

Under claim placement every shard holds every restored record, and the first shard to claim a
key keeps it: every other shard drops its copy before the claim is answered, so a later
checkpoint never exports the stale copy beside the live one. Right after a restore of thousands,
the claims come in a burst, one per restored rollout. Each used to be a ``DeleteRestored`` round
trip to every other shard, two thirds of a claim's cost. Now a claim adds its key to the batch
being gathered and waits for that batch to be sent. One claim at a time sends; the claims that
arrive while it does are the next batch, sent by one of them as soon as it is done. So a burst
of N claims costs a handful of messages per shard, and a lone claim costs what it did.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio

from protocols import EpisodeId

Send = Callable[[int, Sequence[EpisodeId]], Awaitable[None]]
"""Send one shard (by pid) the episodes whose restored copies it must drop; raise on refusal."""


@dataclass
class _Batch:
    targets: dict[int, list[EpisodeId]] = field(default_factory=dict)
    sent: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None


class StaleCopies:
    """Drop restored copies on other shards, batching the drops of concurrent claims."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._gathering: _Batch | None = None
        self._sending: anyio.Event | None = None
        self.messages = 0
        """Messages sent so far (one per shard per batch)."""

    async def drop(self, shards: Iterable[int], episode: EpisodeId) -> None:
        """Return once every shard of ``shards`` has dropped its copy of ``episode``.

        Raises:
            Exception: What sending the batch holding it raised (a shard's refusal, or no reply
                within the message timeout).
        """
        batch = self._gathering
        if batch is None:
            batch = self._gathering = _Batch()
        for pid in shards:
            batch.targets.setdefault(pid, []).append(episode)
        while not batch.sent.is_set():
            if self._sending is not None:
                await self._sending.wait()  # then ours was sent, or it is our turn to send
                continue
            # Nobody is sending, and ours is not sent: it is the batch being gathered.
            sending = self._sending = anyio.Event()
            current, self._gathering = self._gathering, None
            try:
                assert current is batch
                with anyio.CancelScope(shield=True):  # the waiters of this batch depend on it
                    await self._send_batch(current)
            finally:
                self._sending = None
                sending.set()
        if batch.error is not None:
            raise batch.error

    async def _send_batch(self, batch: _Batch) -> None:
        errors: list[Exception] = []

        async def one(pid: int, episodes: list[EpisodeId]) -> None:
            try:
                await self._send(pid, episodes)
            except Exception as exc:
                errors.append(exc)

        try:
            async with anyio.create_task_group() as group:
                for pid, episodes in batch.targets.items():
                    self.messages += 1
                    group.start_soon(one, pid, episodes)
            batch.error = errors[0] if errors else None
        finally:
            batch.sent.set()
