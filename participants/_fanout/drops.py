"""The restored copies a claim makes stale, dropped in one message per shard for the claims
that come together (D393, D394).

Under claim placement every shard holds every restored record, and the first shard to claim a
key keeps it: every other shard drops its copy before the claim is answered, so a later
checkpoint never exports the stale copy beside the live one. Right after a restore of thousands,
the claims come in a burst, one per restored rollout. Each used to be a ``DeleteRestored`` round
trip to every other shard, two thirds of a claim's cost. Now the first claim of a batch waits
``GATHER_SECONDS`` for others to join it, and then sends the batch; every claim of it is
answered when its message is. Batches do not wait for each other: a shard slow to answer one
delays only the claims that one holds (D394). A batch gathers only the claims that tell the same
shards, so a claim never waits for a shard it did not need (D396). A lone claim costs one
message per shard, as before, and ``GATHER_SECONDS`` more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio

from protocols import EpisodeId

GATHER_SECONDS: Final = 0.005
"""How long the first claim of a batch waits for others to join it (D394)."""

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
        self._gathering: dict[frozenset[int], _Batch] = {}
        """The batch being gathered for each set of shards to tell (D396)."""
        self.messages = 0
        """Messages sent so far (one per shard per batch)."""

    async def drop(self, shards: Iterable[int], episode: EpisodeId) -> None:
        """Return once every shard of ``shards`` has dropped its copy of ``episode``.

        Raises:
            Exception: What sending the batch holding it raised (a shard's refusal, or no reply
                within the message timeout).
        """
        told = frozenset(shards)
        if not told:
            return  # the only shard: nothing to tell, and nothing to wait for
        batch = self._gathering.get(told)
        first = batch is None
        if batch is None:
            batch = self._gathering[told] = _Batch()
        for pid in told:
            batch.targets.setdefault(pid, []).append(episode)
        if first:
            with anyio.CancelScope(shield=True):  # the other claims of the batch wait on it
                await anyio.sleep(GATHER_SECONDS)  # the claims that come meanwhile join it
                del self._gathering[told]  # later claims start the next batch
                await self._send_batch(batch)
        else:
            await batch.sent.wait()
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
