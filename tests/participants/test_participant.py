"""The participant building blocks' small parts: the change notifier."""

from __future__ import annotations

import anyio
import pytest

from participants import ChangeNotifier

pytestmark = pytest.mark.anyio


async def test_every_waiter_wakes_at_the_next_notification_even_after_unwatched_ones() -> None:
    # D261: the event is made by the first waiter, so notifications nobody waits for are cheap;
    # a waiter arriving after any number of them still wakes at the next one.
    changes = ChangeNotifier()
    for _ in range(3):
        changes.notify()  # nobody waits
    seen = changes.version
    woken: list[int] = []

    async def wait(name: int) -> None:
        await changes.wait_past(seen)
        woken.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(wait, 1)
            group.start_soon(wait, 2)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            changes.notify()
    assert sorted(woken) == [1, 2]


async def test_a_waiter_behind_the_version_returns_at_once() -> None:
    changes = ChangeNotifier()
    seen = changes.version
    changes.notify()
    with anyio.fail_after(5):
        await changes.wait_past(seen)
