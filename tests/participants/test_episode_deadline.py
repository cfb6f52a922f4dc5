"""An episode's budget: counts while running, stops while suspended, cancels when used up."""

from __future__ import annotations

import anyio
import pytest

from participants import ManualClock
from participants._environment.deadline import EpisodeDeadline

pytestmark = pytest.mark.anyio


async def test_the_watch_cancels_the_work_once_the_budget_is_used_up() -> None:
    clock = ManualClock()
    deadline = EpisodeDeadline(clock, 10.0)
    work = anyio.CancelScope()
    async with anyio.create_task_group() as group:
        group.start_soon(deadline.watch, work)
        await anyio.wait_all_tasks_blocked()
        clock.advance(9.5)
        await anyio.wait_all_tasks_blocked()
        assert not work.cancel_called
        clock.advance(0.5)
        await anyio.wait_all_tasks_blocked()
    assert work.cancel_called
    assert deadline.expired


async def test_suspended_time_is_not_counted_and_the_rest_carries_over() -> None:
    clock = ManualClock()
    deadline = EpisodeDeadline(clock, 10.0)
    work = anyio.CancelScope()
    async with anyio.create_task_group() as group:
        group.start_soon(deadline.watch, work)
        clock.advance(6.0)
        deadline.suspend()
        await anyio.wait_all_tasks_blocked()
        clock.advance(1000.0)
        await anyio.wait_all_tasks_blocked()
        assert not work.cancel_called
        assert deadline.remaining() == 4.0
        deadline.resume()
        await anyio.wait_all_tasks_blocked()
        clock.advance(3.9)
        await anyio.wait_all_tasks_blocked()
        assert not work.cancel_called
        clock.advance(0.1)
        await anyio.wait_all_tasks_blocked()
    assert work.cancel_called


async def test_suspend_and_resume_are_idempotent() -> None:
    clock = ManualClock()
    deadline = EpisodeDeadline(clock, 10.0)
    clock.advance(2.0)
    deadline.suspend()
    clock.advance(5.0)
    deadline.suspend()
    assert deadline.suspended
    assert deadline.remaining() == 8.0
    deadline.resume()
    clock.advance(1.0)
    deadline.resume()  # must not restart the count from now
    assert deadline.remaining() == 7.0


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        EpisodeDeadline(ManualClock(), 0.0)
