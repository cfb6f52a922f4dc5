"""The drill with every server hosted by Ray, checkpoints on S3, crashes that kill Ray's processes.

``midflight drill --on ray --checkpoint-store s3`` starts a local Ray head on 127.0.0.1 and a
local S3 server; every server runs in a named actor (``max_restarts=0``), each crash SIGKILLs
every process those actors run, and fresh actors restore from the last checkpoint on S3. The
test checks the drill's figures and that no process of any Ray head outlived the drill.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e2e._drill.oracle import ERROR_FIGURES
from e2e._launch.ray_head import processes_of
from e2e._servers.cluster import read_cluster
from e2e._servers.evidence import read_evidence
from tests.e2e.processes import drill_json
from tests.e2e.test_drill import SMALL

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


def test_the_drill_on_ray_with_checkpoints_on_s3_is_green_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    code, figures = drill_json(tmp_path, *SMALL, "--on", "ray", "--checkpoint-store", "s3")
    assert {name: figures[name] for name in ERROR_FIGURES} == dict.fromkeys(ERROR_FIGURES, 0), (
        figures
    )
    assert code == 0, figures["failures"]
    assert figures["on"] == "ray"
    assert figures["crashes"] >= 2 and figures["cut_continued"] > 0
    assert all(n > 0 for n in figures["restored_per_crash"])
    # Every crash killed every server's process: one actor process per server of the cluster.
    servers = read_cluster(tmp_path / "run" / "cluster.toml").servers
    assert figures["ray_processes_killed"] == [len(servers)] * figures["crashes"], figures
    assert figures["checkpoint_store"].startswith("s3://midflight/drill-")
    assert not (tmp_path / "run" / "checkpoints").exists()
    events = read_evidence(tmp_path / "run" / "evidence" / "driver.jsonl")
    assert sum(1 for e in events if e.get("event") == "restore") == figures["crashes"]
    # The servers logged into the run directory, one log per actor incarnation.
    assert len(list((tmp_path / "run" / "logs").glob("policy-*.log"))) == figures["crashes"] + 1
    assert figures["ray_left_running"] == 0
    # Nothing of the drill's head runs: no process with its marker, writing into its directory,
    # or below either (another test's head may run beside this one: it is not looked at).
    head = figures["ray_head"]
    assert processes_of(head["id"], Path(head["temp_dir"])) == []
    assert not Path(head["temp_dir"]).exists()


def test_drill_on_ray_refuses_the_matrix_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "e2e", "drill", "--on", "ray", "--matrix", "small"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--on ray" in done.stderr, done.stderr
