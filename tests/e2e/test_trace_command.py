"""``midflight trace``: real spans of several processes (``trace_spans``) read back as checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from e2e import build_app
from tests.e2e.trace_spans import T0, at, build_trace_dir

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def traced(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The trace directory of :func:`build_trace_dir` and its trace ids."""
    trace_dir = tmp_path / "trace"
    return trace_dir, build_trace_dir(trace_dir, tmp_path / "scratch")


def invoke(*args: str) -> Any:
    return runner.invoke(build_app(), ["trace", *args])


def lane(label: str, role: str, server: str, process: str, pid: int, service: str) -> Any:
    return {
        "label": label,
        "role": role,
        "server": server,
        "process": process,
        "pid": pid,
        "service": f"midflight-{service}",
    }


def stage(name: str, start_ms: int, end_ms: int) -> dict[str, Any]:
    return {
        "name": name,
        "start_s": start_ms / 1000,
        "end_s": end_ms / 1000,
        "seconds": round((end_ms - start_ms) / 1000, 6),
    }


def test_the_json_of_one_checkpoint_is_read_from_every_process(
    traced: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    trace_dir, ids = traced
    out = tmp_path / "pictures" / "ck3.png"
    result = invoke(str(trace_dir), "--checkpoint", "ck-0003", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["out"] == str(out) and payload["drawn"] == "ck-0003"
    assert payload["checkpoints"] == [
        {
            "checkpoint_id": "ck-0003",
            "trace_id": ids["ck3"],
            "start_ns": T0,
            "root_seen": True,
            "published": True,
            "rollouts": 12,
            "participants": ["agent", "environment", "model", "resources-exported"],
            "lanes": [
                lane("driver", "coordinator", "driver", "main", 4002, "driver"),
                lane("agent", "participant", "agent", "main", 4111, "agent"),
                lane("environment", "participant", "environment", "main", 4101, "environment"),
                lane("model", "participant", "model", "main", 4201, "model"),
                lane("model shard 4202", "participant", "model", "shard", 4202, "model"),
                # Only an orphan (its parent never ended) is in this shard's file: still a lane.
                lane("model shard 4203", "participant", "model", "shard", 4203, "model"),
                lane(
                    "resources-exported",
                    "participant",
                    "resources-exported",
                    "main",
                    4301,
                    "resources",
                ),
                lane("worker", "worker", "worker", "main", 4401, "worker"),
            ],
            # The environment's prepare starts at 7 ms, the model's resume ends at 410 ms; the
            # root lasts 420 ms.
            "pause_s": 0.403,
            "pause_basis": "prepare_to_resume",
            "stages": [
                stage("prepare/environment", 5, 100),
                stage("prepare/agent", 100, 130),
                stage("prepare/model", 130, 220),
                stage("prepare/resources", 220, 250),
                stage("commit", 250, 350),
                stage("publish", 350, 360),
                stage("resume", 360, 415),
            ],
            "blockers": {"total": 2, "participants": {"agent": 2}},
            "cuts": [
                {
                    "participant": "model",
                    "start_s": 0.14,
                    "seconds": 0.06,
                    "calls": 6,
                    "cut": 5,
                    "cut_failed": 0,
                    "cut_skipped": 1,
                    "workers": 1,
                }
            ],
            "refusals": [],
            "restores": [ids["restore"]],
        }
    ]
    # With --checkpoint, only the restores of that checkpoint.
    assert payload["restores"] == [
        {
            "trace_id": ids["restore"],
            "restore_id": "restore-1",
            "checkpoint_id": "ck-0003",
            "checkpoint_trace_id": ids["ck3"],
            "linked_by": "link",
            "checkpoint_in_directory": True,
            "participants": ["environment", "model"],
            "start_ns": at(1000),
            "seconds": 0.3,
        }
    ]


def test_every_checkpoint_is_listed_and_the_last_one_drawn_beside_the_spans(
    traced: tuple[Path, dict[str, str]],
) -> None:
    trace_dir, ids = traced
    result = invoke(str(trace_dir), "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [c["checkpoint_id"] for c in payload["checkpoints"]] == ["ck-0002", "ck-0003"]
    assert payload["drawn"] == "ck-0003"
    assert payload["out"] == str(trace_dir / "timeline-ck-0003.png")
    # ck-0002's driver was killed: no root, no resume; its one coordinator span is an orphan.
    old = payload["checkpoints"][0]
    assert old["trace_id"] == ids["ck2"] and not old["root_seen"]
    assert (old["published"], old["pause_basis"], old["pause_s"]) == (None, "spans", 0.049)
    assert old["stages"] == [stage("prepare/environment", 0, 24)]
    assert old["participants"] == ["environment"]
    assert old["refusals"] == [
        {
            "participant": "environment",
            "operation": "commit",
            "outcome": "refused",
            "code": "stale_checkpoint",
        }
    ]
    assert old["restores"] == [ids["rootless"]]


def test_restores_are_matched_by_link_or_by_id_and_kept_when_their_checkpoint_is_elsewhere(
    traced: tuple[Path, dict[str, str]],
) -> None:
    trace_dir, ids = traced
    restores = json.loads(invoke(str(trace_dir), "--json").stdout)["restores"]
    matched = [
        (r["trace_id"], r["checkpoint_id"], r["checkpoint_trace_id"], r["linked_by"])
        for r in restores
    ]
    assert matched == [
        (ids["restore"], "ck-0003", ids["ck3"], "link"),
        (ids["elsewhere"], "ck-0001", f"{0xABC:032x}", "link"),
        (ids["rootless"], "ck-0002", ids["ck2"], "id"),
    ]
    assert [r["checkpoint_in_directory"] for r in restores] == [True, False, True]


def test_the_picture_is_a_png(traced: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    trace_dir, _ = traced
    out = tmp_path / "timeline.png"
    assert invoke(str(trace_dir), "--out", str(out)).exit_code == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 20_000, "a picture of eight lanes, not an empty canvas"


def test_the_summary_for_people_names_each_checkpoint_and_the_picture(
    traced: tuple[Path, dict[str, str]],
) -> None:
    trace_dir, _ = traced
    result = invoke(str(trace_dir))
    assert result.exit_code == 0, result.output
    text = result.stdout
    rows = {
        line.split()[1]: line.split("│")[2:-1]
        for line in text.splitlines()
        if "ck-000" in line and "│" in line
    }
    assert [cell.strip() for cell in rows["ck-0002"]] == ["0.049 s", "1", "?", "0", "missing"]
    assert [cell.strip() for cell in rows["ck-0003"]] == [
        "0.403 s",
        "4",
        "yes",
        "agent 2",
        "seen",
    ]
    assert "restore restore-9 continued ck-0001" in text
    assert "restore restore-1 continued ck-0003" in text
    assert "(its checkpoint is not in DIR)" in text
    assert f"timeline of ck-0003: {trace_dir / 'timeline-ck-0003.png'}\n" in text


def test_without_matplotlib_the_figures_still_print(
    traced: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_dir, _ = traced
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke(str(trace_dir), "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["out"] is None and len(payload["checkpoints"]) == 2
    assert "no timeline drawn: matplotlib is missing" in result.stderr
    assert not (trace_dir / "timeline-ck-0003.png").exists()


def usage_cases(tmp_path: Path, trace_dir: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "spans-midflight-driver-1.jsonl").write_text(
        (trace_dir / "spans-midflight-driver-4002.jsonl").read_text().splitlines()[-1][:40]
    )
    return {
        "missing": ([str(tmp_path / "nowhere")], "no such directory"),
        "file": ([str(tmp_path / "a-file")], "not a directory"),
        "empty": ([str(tmp_path / "empty")], "no spans files"),
        "no checkpoint": ([str(tmp_path / "rollouts")], "no checkpoint in its 0 spans"),
        "unknown id": (
            [str(trace_dir), "--checkpoint", "ck-9"],
            "no checkpoint 'ck-9' in",
        ),
    }


@pytest.mark.parametrize("case", ["missing", "file", "empty", "no checkpoint", "unknown id"])
def test_a_usage_error_is_one_line_and_exit_2(
    traced: tuple[Path, dict[str, str]], tmp_path: Path, case: str
) -> None:
    args, message = usage_cases(tmp_path, traced[0])[case]
    result = invoke(*args, "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.process
def test_the_command_line_process_reports_an_unknown_checkpoint_without_a_traceback(
    traced: tuple[Path, dict[str, str]],
) -> None:
    trace_dir, _ = traced
    completed = subprocess.run(
        [sys.executable, "-m", "e2e", "trace", str(trace_dir), "--checkpoint", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert completed.returncode == 2
    assert completed.stderr.startswith("error: no checkpoint 'nope' in ")
    assert len(completed.stderr.splitlines()) == 1 and "Traceback" not in completed.stderr
    assert "ck-0002, ck-0003" in completed.stderr
