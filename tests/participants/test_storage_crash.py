"""A write killed with SIGKILL at any point leaves either no manifest or a verifiable one."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from participants import WRITE_STEPS, read_participant_checkpoint
from protocols import InvalidCheckpointStateError
from tests.e2e.processes import kill_group

pytestmark = pytest.mark.process
REPO = Path(__file__).resolve().parents[2]


def _spawn(directory: Path, step: str, records: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.participants.crash_writer",
            str(directory),
            step,
            str(records),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _assert_none_or_verifiable(directory: Path) -> bool:
    """True when a manifest exists (and then it verifies), False when none does."""
    if not (directory / "manifest.json").exists():
        with pytest.raises(InvalidCheckpointStateError, match="partial"):
            read_participant_checkpoint(directory, kind="model", instance="policy")
        return False
    share = read_participant_checkpoint(directory, kind="model", instance="policy")
    assert len(share.records) == share.manifest["record_count"]
    return True


@pytest.mark.parametrize("step", WRITE_STEPS)
def test_sigkill_at_each_step(tmp_path: Path, step: str) -> None:
    process = _spawn(tmp_path, step, 500)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line == f"at {step}"
    finally:  # killed even when it says something else: it must not outlive the test
        kill_group(process)
    published = _assert_none_or_verifiable(tmp_path)
    # Before the hard link there is no manifest; from the link on, there is a verifiable one.
    assert published == (WRITE_STEPS.index(step) >= WRITE_STEPS.index("manifest_linked"))


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    checked = 0
    for _round in range(6):
        root = tmp_path / f"round{_round}"
        process = _spawn(root, "none", 3000)
        try:
            assert process.stdout is not None
            assert process.stdout.readline().startswith("start")
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            kill_group(process)
        for directory in sorted(p for p in root.iterdir() if p.is_dir()):
            _assert_none_or_verifiable(directory)
            checked += 1
    assert checked >= 6
