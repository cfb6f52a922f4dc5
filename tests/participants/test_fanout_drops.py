"""The stale restored copies of claimed keys, dropped in batches (D393, D394, D396)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from participants._fanout.drops import StaleCopies
from protocols import EpisodeId, WireError

from .test_fanout_group import Shard, server

pytestmark = pytest.mark.anyio
EPISODES = [EpisodeId(rollout_id=f"r{n}", attempt=1) for n in range(50)]


class Shards:
    """A send that records each message as it arrives, holding those with a ``held`` key until
    ``release`` and refusing those with a ``refused`` key."""

    def __init__(self, held: set[str] | None = None, refused: set[str] | None = None) -> None:
        self.arrived: list[tuple[int, list[str]]] = []
        self.answered: list[str] = []
        self.release = anyio.Event()
        self.held = held or set()
        self.refused = refused or set()
        self._arrivals: dict[str, anyio.Event] = {}

    def arrival(self, key: str) -> anyio.Event:
        """Set once a message holding ``key`` has arrived."""
        return self._arrivals.setdefault(key, anyio.Event())

    async def send(self, pid: int, episodes: Sequence[EpisodeId]) -> None:
        keys = [e.capture_key for e in episodes]
        self.arrived.append((pid, keys))
        for key in keys:
            self.arrival(key).set()
        if self.held & set(keys):
            await self.release.wait()
        if self.refused & set(keys):
            raise WireError("no")
        self.answered.extend(keys)


async def _in_flight(shards: Shards, key: str) -> None:
    """Wait until the message holding ``key`` has arrived (the gathering window is over)."""
    with anyio.fail_after(5):
        await shards.arrival(key).wait()


async def test_a_lone_drop_is_one_message_to_each_other_shard() -> None:
    shards = Shards()
    drops = StaleCopies(shards.send)
    await drops.drop([2, 3], EPISODES[0])
    assert sorted(shards.arrived) == [(2, ["r0-a1"]), (3, ["r0-a1"])]
    assert drops.messages == 2
    # No other shard: no message, and no window; the call returns without suspending once.
    alone = drops.drop([], EPISODES[1])
    with pytest.raises(StopIteration):
        alone.send(None)
    assert drops.messages == 2


async def test_drops_that_come_together_go_in_one_message_and_wait_for_its_answer() -> None:
    shards = Shards(held={"r0-a1"})
    drops = StaleCopies(shards.send)
    returned: list[str] = []

    async def drop(episode: EpisodeId) -> None:
        await drops.drop([2], episode)
        assert episode.capture_key in shards.answered  # back only once its message was answered
        returned.append(episode.capture_key)

    async with anyio.create_task_group() as group:
        try:  # a failure lets the held message go, so that the shielded send ends
            for episode in EPISODES:
                group.start_soon(drop, episode)
            await _in_flight(shards, "r0-a1")
            assert returned == []  # the message is held: nobody is answered yet
        finally:
            shards.release.set()
    assert shards.arrived == [(2, [e.capture_key for e in EPISODES])]
    assert sorted(returned) == sorted(e.capture_key for e in EPISODES)


async def test_a_batch_slow_to_be_answered_does_not_hold_up_the_next() -> None:
    """D394: the drill of 4,000 lost 530 rollouts when every claim queued behind the batch a
    loaded shard was slow to answer."""
    shards = Shards(held={"r0-a1"})
    drops = StaleCopies(shards.send)
    async with anyio.create_task_group() as group:
        try:
            group.start_soon(drops.drop, [2], EPISODES[0])
            await _in_flight(shards, "r0-a1")
            with anyio.fail_after(5):
                await drops.drop([2], EPISODES[1])  # answered while the first is still held
            assert shards.answered == ["r1-a1"]
        finally:
            shards.release.set()
    assert shards.answered == ["r1-a1", "r0-a1"]


async def test_a_drop_waits_only_for_the_shards_it_tells() -> None:
    """D396: two claims at once from two shards tell each other; a shard slow to answer holds
    up the claims that need it, not the other shard's."""
    shards = Shards(held={"r0-a1"})
    drops = StaleCopies(shards.send)
    async with anyio.create_task_group() as group:
        try:
            group.start_soon(drops.drop, [2], EPISODES[0])  # held by shard 2
            with anyio.fail_after(5):
                await drops.drop([3], EPISODES[1])  # in the same window, told shard 3 only
            assert shards.answered == ["r1-a1"]
        finally:
            shards.release.set()
    assert sorted(shards.arrived) == [(2, ["r0-a1"]), (3, ["r1-a1"])]


async def test_a_refused_message_fails_the_drops_it_held_and_no_others() -> None:
    shards = Shards(held={"r0-a1"}, refused={"r3-a1"})
    drops = StaleCopies(shards.send)
    failed: list[str] = []

    async def drop(episode: EpisodeId) -> None:
        try:
            await drops.drop([2], episode)
        except WireError:
            failed.append(episode.capture_key)

    async with anyio.create_task_group() as group:
        try:
            group.start_soon(drop, EPISODES[0])
            await _in_flight(shards, "r0-a1")
            for episode in EPISODES[1:5]:
                group.start_soon(drop, episode)
            await _in_flight(shards, "r1-a1")
        finally:
            shards.release.set()
    assert shards.arrived == [(2, ["r0-a1"]), (2, ["r1-a1", "r2-a1", "r3-a1", "r4-a1"])]
    assert sorted(failed) == ["r1-a1", "r2-a1", "r3-a1", "r4-a1"]
    await drops.drop([2], EPISODES[9])  # and the next batch goes out as usual
    assert shards.arrived[-1] == (2, ["r9-a1"])


@pytest.mark.parametrize("when", ["gathering", "sending"])
async def test_a_cancelled_first_drop_still_sends_what_the_others_wait_for(when: str) -> None:
    shards = Shards(held={"r0-a1"})
    drops = StaleCopies(shards.send)
    first = anyio.CancelScope()
    second = anyio.Event()

    async def first_drop() -> None:
        with first:
            await drops.drop([2], EPISODES[0])

    async def then_second() -> None:
        await drops.drop([2], EPISODES[1])
        second.set()

    async with anyio.create_task_group() as group:
        try:
            group.start_soon(first_drop)
            group.start_soon(then_second)  # joins the first one's batch
            await anyio.wait_all_tasks_blocked()
            if when == "sending":
                await _in_flight(shards, "r0-a1")
            first.cancel()  # the caller of the first drop goes away
        finally:
            shards.release.set()
        with anyio.fail_after(5):
            await second.wait()
    assert shards.arrived == [(2, ["r0-a1", "r1-a1"])]


async def test_a_burst_of_claims_drops_the_stale_copies_in_a_few_messages(tmp_path: Path) -> None:
    """D393, D394: 300 claims at once, as after a restore; each is answered only once the other
    shard dropped its copy, and the drops went in a few messages, not one per claim."""
    async with server(tmp_path, placement="claim") as made:
        a = await made.join(101, 0)
        b = await made.join(102, 1)
        episodes = [EpisodeId(rollout_id=f"r{n}") for n in range(300)]
        records = [{"episode_id": e.model_dump(), "step": 1} for e in episodes]
        await made.fanout.install(records, episodes)
        keys = [e.next_attempt().capture_key for e in episodes]
        stale: list[str] = []

        async def claim(key: str, mine: Shard, other: Shard) -> None:
            assert await mine.shard.claim(key)
            if key in other.fake.restored:
                stale.append(key)

        async with anyio.create_task_group() as group:
            for n, key in enumerate(keys):
                group.start_soon(claim, key, *((a, b) if n % 2 else (b, a)))
        assert stale == []
        assert sorted([*a.fake.restored, *b.fake.restored]) == sorted(keys)
        # One per claim would be 300; a window gathers a few dozen claims here (D394).
        assert made.fanout.stale_copies.messages <= 60
