"""The garbage-collector pause a restore holds while it builds its batch."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from participants._runtime.collector import collector_paused, pauses_active


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_inside_and_on_again_after_even_when_the_block_raises() -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()

    def failing_batch() -> None:
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("the batch failed")

    with pytest.raises(RuntimeError):
        failing_batch()
    assert gc.isenabled() and pauses_active() == 0


def test_overlapping_pauses_end_when_the_last_one_does() -> None:
    first = collector_paused()
    second = collector_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled() and pauses_active() == 1  # the second batch is still being built
    second.__exit__(None, None, None)
    assert gc.isenabled() and pauses_active() == 0


def test_pauses_from_several_threads_leave_the_collector_on() -> None:
    inside = threading.Barrier(4)

    def batch() -> None:
        with collector_paused():
            inside.wait(timeout=10)  # every thread is inside at once
            assert not gc.isenabled()

    threads = [threading.Thread(target=batch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert gc.isenabled() and pauses_active() == 0


def test_a_process_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
