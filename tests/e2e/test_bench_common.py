"""Shared bench helpers: the logging a bench quiets is handed back, the checkpoint floor, and
the profile's split of CPU between the event loop's thread and the others."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import structlog

from e2e._bench.common import quiet_logs, write_floor
from e2e._bench.output import Profile


def test_quiet_logs_gives_the_previous_logging_back() -> None:
    before = structlog.get_config()
    with quiet_logs():
        assert structlog.get_config()["wrapper_class"] is not before["wrapper_class"]
        assert not structlog.get_logger().is_enabled_for(logging.INFO)
    # A bench run inside a test session must not leave a stream it swapped in behind.
    assert structlog.get_config() == before


def test_the_floor_writes_every_byte_of_every_file(tmp_path: Path) -> None:
    files = {"a": b"x" * 10, "b": b"", "c": b"yz"}
    assert write_floor(files, tmp_path / "floor") > 0
    written = sorted(path.read_bytes() for path in (tmp_path / "floor").iterdir())
    assert written == [b"", b"x" * 10, b"yz"]


def _spin(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_the_profile_says_how_much_cpu_other_threads_spent_outside_its_tree(
    tmp_path: Path,
) -> None:
    # The servers' file work runs in threads that pyinstrument does not sample; a profile whose
    # tree shows the loop waiting must say how much CPU went elsewhere meanwhile.
    profile = Profile(tmp_path / "p.html")
    with profile.section():
        worker = threading.Thread(target=_spin, args=(0.3,))
        worker.start()
        worker.join()
    with profile.section():  # sections add up
        _spin(0.05)
    text = next(path for path in profile.write() if path.suffix == ".txt").read_text()
    first = text.splitlines()[0]
    found = re.fullmatch(
        r"CPU in the timed sections: ([\d.]+) s in all, ([\d.]+) s on the event loop's thread "
        r"\(the tree below\), ([\d.]+) s on other threads \(not in the tree: there the loop waits\)",
        first,
    )
    assert found is not None, first
    total, loop, others = (float(group) for group in found.groups())
    assert others >= 0.29
    assert 0.05 <= loop < 0.2
    assert abs(total - loop - others) < 0.002
