"""Shared bench helpers: the logging a bench quiets is handed back, and the checkpoint floor."""

from __future__ import annotations

import logging
from pathlib import Path

import structlog

from e2e._bench.common import quiet_logs, write_floor


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
