"""The stale restored copies of claimed keys, dropped in batches (D393)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from participants._fanout.drops import StaleCopies
from protocols import EpisodeId, WireError

pytestmark = pytest.mark.anyio
EPISODES = [EpisodeId(rollout_id=f"r{n}", attempt=1) for n in range(50)]


class Shards:
    """A send that records each message, and holds the first until released."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[str]]] = []
        self.release = anyio.Event()
        self.refuse: set[str] = set()

    async def send(self, pid: int, episodes: Sequence[EpisodeId]) -> None:
        keys = [e.capture_key for e in episodes]
        if not self.sent:
            await self.release.wait()
        self.sent.append((pid, keys))
        if self.refuse & set(keys):
            raise WireError("no")


async def test_a_lone_drop_is_one_message_to_each_other_shard() -> None:
    shards = Shards()
    shards.release.set()
    drops = StaleCopies(shards.send)
    await drops.drop([2, 3], EPISODES[0])
    assert sorted(shards.sent) == [(2, ["r0-a1"]), (3, ["r0-a1"])]
    assert drops.messages == 2


async def test_drops_that_come_while_one_is_sent_go_together_and_wait_for_it() -> None:
    shards = Shards()
    drops = StaleCopies(shards.send)
    returned: list[str] = []

    async def drop(episode: EpisodeId) -> None:
        await drops.drop([2], episode)
        # Back only once the message holding this key reached the shard.
        assert any(episode.capture_key in keys for _, keys in shards.sent)
        returned.append(episode.capture_key)

    async with anyio.create_task_group() as group:
        try:  # a failure lets the held message go, so the shielded send ends
            for episode in EPISODES:
                group.start_soon(drop, episode)
            await anyio.wait_all_tasks_blocked()
            assert returned == []  # the first message is held: nobody is answered yet
        finally:
            shards.release.set()
    assert shards.sent == [(2, ["r0-a1"]), (2, [e.capture_key for e in EPISODES[1:]])]
    assert sorted(returned) == sorted(e.capture_key for e in EPISODES)


async def test_a_refused_message_fails_the_drops_it_held_and_no_others() -> None:
    shards = Shards()
    shards.refuse = {"r3-a1"}
    drops = StaleCopies(shards.send)
    failed: list[str] = []

    async def drop(episode: EpisodeId) -> None:
        try:
            await drops.drop([2], episode)
        except WireError:
            failed.append(episode.capture_key)

    async with anyio.create_task_group() as group:
        for episode in EPISODES[:5]:
            group.start_soon(drop, episode)
        await anyio.wait_all_tasks_blocked()
        shards.release.set()
    assert sorted(failed) == ["r1-a1", "r2-a1", "r3-a1", "r4-a1"]  # r0 went alone, and first
    await drops.drop([2], EPISODES[9])  # and the next batch goes out as usual
    assert shards.sent[-1] == (2, ["r9-a1"])


async def test_a_cancelled_sender_still_sends_what_the_others_wait_for() -> None:
    shards = Shards()
    drops = StaleCopies(shards.send)
    first = anyio.CancelScope()

    async def first_drop() -> None:
        with first:
            await drops.drop([2], EPISODES[0])

    async with anyio.create_task_group() as group:
        group.start_soon(first_drop)
        await anyio.wait_all_tasks_blocked()
        second = anyio.Event()

        async def then_second() -> None:
            await drops.drop([2], EPISODES[1])
            second.set()

        group.start_soon(then_second)
        await anyio.wait_all_tasks_blocked()
        first.cancel()  # the caller of the first drop goes away mid-send
        shards.release.set()
        with anyio.fail_after(5):
            await second.wait()
    assert shards.sent == [(2, ["r0-a1"]), (2, ["r1-a1"])]
