"""Named kill points: inert without the test flag, one announcement, then standing still."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from participants import read_kill_announcements
from participants.testing import KILL_FILE_ENV, KILL_POINT_ENV, TEST_HOOKS_ENV, KillPoint


def _env(tmp_path: Path, spec: str, *, hooks: str = "1") -> dict[str, str]:
    return {
        TEST_HOOKS_ENV: hooks,
        KILL_POINT_ENV: spec,
        KILL_FILE_ENV: str(tmp_path / "kill.jsonl"),
    }


def test_without_the_test_flag_nothing_is_armed(tmp_path: Path) -> None:
    point = KillPoint("agent", _env(tmp_path, "agent:prepare-sent", hooks="0"))
    assert not point.armed
    point.reach("prepare-sent")  # returns: nothing blocks, nothing is written
    assert not (tmp_path / "kill.jsonl").exists()


def test_only_the_named_process_is_armed(tmp_path: Path) -> None:
    assert KillPoint("agent", _env(tmp_path, "agent:records-written")).armed
    assert not KillPoint("model", _env(tmp_path, "agent:records-written")).armed


@pytest.mark.parametrize("spec", ["agent:nowhere", "agent:prepare-sent@0", "agent:prepare-sent@x"])
def test_a_bad_spec_is_refused(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ValueError, match=KILL_POINT_ENV):
        KillPoint("agent", _env(tmp_path, spec))


def test_the_point_is_due_on_its_occurrence_and_once_per_file(tmp_path: Path) -> None:
    first = KillPoint("agent", _env(tmp_path, "agent:resume-partly-sent@2"))
    assert not first._due("prepare-sent")
    assert not first._due("resume-partly-sent")
    # The count lives in the file: the next incarnation's first reach is the second in all.
    point = KillPoint("agent", _env(tmp_path, "agent:resume-partly-sent@2"))
    assert point._due("resume-partly-sent")
    point._announce()
    # A fresh process on the same file (the restarted server) runs through it.
    again = KillPoint("agent", _env(tmp_path, "agent:resume-partly-sent@1"))
    assert not again._due("resume-partly-sent")


def test_a_process_announces_durably_then_stands_still_until_killed(tmp_path: Path) -> None:
    code = (
        "from participants.testing import KillPoint; KillPoint('controller').reach('prepare-sent')"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **_env(tmp_path, "controller:prepare-sent")},
    )
    try:
        deadline = time.monotonic() + 60
        while not read_kill_announcements(tmp_path / "kill.jsonl"):
            assert process.poll() is None, "the process ended instead of announcing"
            assert time.monotonic() < deadline, "no announcement within 60 s"
            time.sleep(0.05)
        # It waits for the kill instead of carrying on (or exiting).
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=3)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    [announcement] = read_kill_announcements(tmp_path / "kill.jsonl")
    assert announcement["process"] == "controller"
    assert announcement["boundary"] == "prepare-sent"
    assert announcement["pid"] == process.pid


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "kill.jsonl"
    path.write_text(json.dumps({"boundary": "prepare-sent"}) + '\n{"boun')
    assert read_kill_announcements(path) == [{"boundary": "prepare-sent"}]
