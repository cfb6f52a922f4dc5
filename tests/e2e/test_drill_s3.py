"""The drill and the kill -9 matrix with every checkpoint on S3 (a local moto server).

Real server processes, real SIGKILLs and restores, as in ``test_drill.py``; the drill starts its
own S3 API server on 127.0.0.1 (``--checkpoint-store s3``), and every server and controller
incarnation commits, publishes and restores through it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e2e._drill.matrix import SMALL_MATRIX
from e2e._drill.oracle import ERROR_FIGURES
from e2e._servers.evidence import read_evidence
from tests.e2e.processes import drill_json
from tests.e2e.test_drill import SMALL
from tests.e2e.test_matrix import _matrix

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]


def test_the_drill_on_s3_is_green_and_leaves_its_checkpoints_as_objects(tmp_path: Path) -> None:
    code, figures = drill_json(tmp_path, *SMALL, "--checkpoint-store", "s3")
    assert {name: figures[name] for name in ERROR_FIGURES} == dict.fromkeys(ERROR_FIGURES, 0), (
        figures
    )
    assert code == 0, figures["failures"]
    assert figures["checkpoints"] == 3 and figures["crashes"] == 2
    assert all(n > 0 for n in figures["restored_per_crash"])
    assert figures["cut_continued"] >= 1
    store = figures["checkpoint_store"]
    assert store.startswith("s3://midflight/drill-") and store.endswith("/run")
    # Three published checkpoints of four participants, each a records object and a manifest,
    # and a checkpoint.json each: the objects the store listed, and no checkpoint on disk.
    assert figures["checkpoint_objects"] >= 3 * (4 * 2 + 1)
    assert not (tmp_path / "run" / "checkpoints").exists()
    events = read_evidence(tmp_path / "run" / "evidence" / "driver.jsonl")
    restored_from = [e["checkpoint_dir"] for e in events if e.get("event") == "restore"]
    assert len(restored_from) == 2, restored_from
    assert all(d.startswith(f"{store}/checkpoints/ckpt-") for d in restored_from), restored_from


def test_the_small_matrix_on_s3_is_green(tmp_path: Path) -> None:
    code, report = _matrix(tmp_path, "small", "--matrix-jobs", "2", "--checkpoint-store", "s3")
    cells = report["cells"]
    assert isinstance(cells, list)
    assert [(c["killed"], c["boundary"]) for c in cells] == list(SMALL_MATRIX)
    assert all(c["ok"] for c in cells), cells
    assert code == 0


@pytest.mark.soak
@pytest.mark.timeout(3000)
def test_the_publication_matrix_on_s3_is_green(tmp_path: Path) -> None:
    # Every process killed at every boundary where a checkpoint is written (records, manifests,
    # checkpoint.json), each kill followed by a crash and a restore from LATEST on S3.
    code, report = _matrix(
        tmp_path, "publication", "--matrix-jobs", "2", "--checkpoint-store", "s3", timeout=2800
    )
    cells = report["cells"]
    assert isinstance(cells, list) and len(cells) == 10
    assert [c for c in cells if not c["ok"]] == []
    assert code == 0


def test_a_store_the_drill_cannot_use_is_a_usage_error(tmp_path: Path) -> None:
    for bad, says in (
        ("ftp://x", "use disk, s3"),
        ("s3://A_B/x", "not a valid bucket name"),
    ):
        completed = _cli(tmp_path, "--checkpoint-store", bad)
        assert completed.returncode == 2 and says in completed.stderr, completed.stderr
        assert "Traceback" not in completed.stderr
    completed = _cli(tmp_path, "--checkpoint-store", "s3", "--sequences", "1")
    assert completed.returncode == 2 and "sequence suites" in completed.stderr


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "e2e", "drill", "--keep-dir", str(tmp_path / "k"), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
