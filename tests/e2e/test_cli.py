"""The command line: help, version, the demo, and --json on each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

import e2e._bench.common as common_module
from e2e import build_app

runner = CliRunner()


def test_help_lists_the_registered_commands() -> None:
    result = runner.invoke(build_app(), ["--help"])
    assert result.exit_code == 0
    assert "version" in result.output and "demo" in result.output and "serve" in result.output


def test_version_json() -> None:
    result = runner.invoke(build_app(), ["version", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output)["midflight"] == version("midflight")


@pytest.mark.process
def test_demo_json_shows_every_rule(tmp_path: Path) -> None:
    result = runner.invoke(
        build_app(), ["demo", "--json", "--dir", str(tmp_path), "--records", "7"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["manifest"]["record_count"] == 7
    assert payload["round_trip_equal"] and payload["repeat_identical"]
    assert payload["conflicting_commit"] == "invalid_checkpoint_state"
    assert payload["stopped_write"] == "invalid_checkpoint_state"
    assert payload["corrupt_read"].startswith("invalid_checkpoint_state")
    live = payload["participant"]
    assert live["prepare_phase"] == "prepared"
    assert live["prepare_after_resume"] == "stale_checkpoint"
    assert live["crashed_attempt"] == "stale_attempt"
    assert live["continued_steps"] == live["saved_steps"]


def test_the_installed_script_runs() -> None:
    script = Path(sys.executable).with_name("midflight")
    completed = subprocess.run(
        [str(script), "version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert completed.stdout.startswith("midflight ")


def test_serve_lists_the_worker() -> None:
    result = runner.invoke(build_app(), ["serve", "--help"])
    assert result.exit_code == 0
    assert "worker" in result.output


def test_bench_ledger_json_lists_every_operation_beside_its_floor(tmp_path: Path) -> None:
    result = runner.invoke(
        build_app(),
        ["bench", "ledger", "--json", "--rollouts", "12", "--batch", "5", "--dir", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    operations = {row["operation"]: row for row in payload["operations"]}
    assert sorted(operations) == sorted(
        [
            "record",
            "record_concurrent",
            "retire",
            "delete",
            "manifest",
            "manifest_concurrent",
            "import_rows_many",
        ]
    )
    for row in operations.values():
        assert row["us_per_rollout"] > 0 and row["floor_us_per_rollout"] > 0
        assert row["ratio"] > 0
    # Sequential record and manifest also show their floor through the event loop -> thread
    # round trip; the ratio keeps its meaning (ours / the bare floor).
    for name in ("record", "manifest"):
        row = operations.pop(name)
        assert row["ratio"] == pytest.approx(
            row["us_per_rollout"] / row["floor_us_per_rollout"], rel=0.01
        )
        assert row["floor_via_thread_us_per_rollout"] > 0
        assert row["hop_us_per_rollout"] == pytest.approx(
            row["floor_via_thread_us_per_rollout"] - row["floor_us_per_rollout"], abs=0.02
        )
        assert row["ratio_to_floor_via_thread"] == pytest.approx(
            row["us_per_rollout"] / row["floor_via_thread_us_per_rollout"], rel=0.01
        )
    assert all("hop_us_per_rollout" not in row for row in operations.values())
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
    # What one thread round trip costs by placement, where threads can be pinned (D444).
    probe = payload["wake_probe_us"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert probe["same_cpu_us"] > 0 and probe["other_cpu_us"] > 0
    else:
        assert probe is None


def test_bench_ledger_table_notes_the_thread_round_trip(tmp_path: Path) -> None:
    args = ["bench", "ledger", "--rollouts", "3", "--batch", "2", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    assert "record" in result.output and "round trip" in result.output
    assert "every manifest pays" in result.output
    if len(os.sched_getaffinity(0)) >= 2:
        assert "pinned to the event loop's CPU" in result.output


@pytest.mark.parametrize("suite", ["ledger", "hotpath"])
def test_a_bench_reports_the_load_average_at_its_start_and_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suite: str
) -> None:
    # A figure on a shared machine is read beside its load (D353).
    readings = iter([(1.5, 1.25, 1.0), (2.5, 2.25, 2.0)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(readings))
    args = ["bench", suite, "--rollouts", "2", "--calls", "2", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), [*args, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["loadavg"] == [1.5, 1.25, 1.0]
    assert payload["loadavg_end"] == [2.5, 2.25, 2.0]
    # And how fast the machine ran a fixed piece of Python, at the start and the end (D426).
    first, last = payload["speed_probe_ms"]
    assert 0 < first < 10_000 and 0 < last < 10_000
    readings = iter([(0.5, 0.25, 0.75), (3.0, 2.0, 1.0)])
    probes = iter([12.5, 20.25])
    monkeypatch.setattr(common_module, "speed_probe_ms", lambda: next(probes))
    result = runner.invoke(build_app(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (
        "load average (1, 5, 15 min): 0.5, 0.25, 0.75 at the start, 3, 2, 1 at the end"
        in result.output
    )
    assert "speed probe: 12.5 ms at the start, 20.25 ms at the end" in result.output


def test_a_bench_table_written_to_a_file_keeps_every_figure_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rich assumes 80 columns when stdout is not a terminal; ten columns of figures then ended in
    # "0.05…". The measurement is replaced: this is about what the table prints.
    import e2e._cli.bench_suites as suites

    row = {
        "rollouts": 16000,
        "parked": 16000,
        "pause_s": 3.461234,
        "boundary_wait_s": 0.022111,
        "overhead_s": 3.439123,
        "floor_s": 0.138234,
        "ratio": 24.88,
        "us_per_rollout": 214.9,
        "slope_us_per_added_rollout": 221.4,
        "bytes": 48317874,
    }
    payload = {"parking": "in-process", "floor": "the same bytes", "rows": [row], "slopes": []}
    monkeypatch.setattr(suites, "run_checkpoint_bench", lambda *a, **k: dict(payload))
    args = ["bench", "checkpoint", "--sizes", "16000", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    for figure in ("16000", "3.461", "0.02211", "3.439", "0.1382", "24.88", "214.9", "48317874"):
        assert figure in result.output, figure


@pytest.mark.parametrize("command", [["status"], ["drill"], ["restore"], ["serve", "worker"]])
def test_help_shows_no_value_placeholder_for_a_flag(command: list[str]) -> None:
    result = runner.invoke(build_app(), [*command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "--help" in result.output
    assert "<bool>" not in result.output, result.output
    assert "<int" in result.output or "<file>" in result.output  # values still show theirs


@pytest.mark.parametrize(
    "args",
    [
        ["status"],  # a required option left out
        ["status", "--cluster", "/nonexistent/cluster.toml"],
        ["drill", "--rollouts", "many"],
        ["bench", "hotpath", "--in-flight", "0"],
        ["verify"],
        ["no-such-command"],
    ],
)
def test_click_s_own_usage_errors_are_one_line_and_exit_2(args: list[str]) -> None:
    result = runner.invoke(build_app(), args, env={"COLUMNS": "80"})
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "--help" in lines[0]


@pytest.mark.parametrize("in_flight", [1, 2])
def test_bench_hotpath_json_gives_every_step_its_share_beside_the_floor(
    tmp_path: Path, in_flight: int
) -> None:
    args = ["bench", "hotpath", "--json", "--rollouts", "3", "--calls", "3", "--dir", str(tmp_path)]
    more = ["--in-flight", str(in_flight), "--tool-bytes", str(100 * in_flight)]
    result = runner.invoke(build_app(), [*args, *more])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["calls"] == 9 and payload["fsync"] == "stubbed"
    assert (payload["in_flight"], payload["tool_bytes"]) == (in_flight, 100 * in_flight)
    steps = {row["step"]: row for row in payload["steps"]}
    assert list(steps) == ["admit", "resolve", "worker_codec", "record", "egress"]
    assert sum(row["cpu_us_per_call"] for row in steps.values()) == pytest.approx(
        payload["cpu_us_per_call"], abs=0.1
    )
    assert sum(row["share"] for row in steps.values()) == pytest.approx(1.0, abs=0.01)
    assert payload["floor_cpu_us_per_call"] > 0
    assert payload["ratio"] == pytest.approx(
        payload["cpu_us_per_call"] / payload["floor_cpu_us_per_call"], rel=0.01
    )
    assert list(tmp_path.iterdir()) == []


def test_bench_hotpath_table_names_the_steps_and_the_floor(tmp_path: Path) -> None:
    args = ["bench", "hotpath", "--rollouts", "2", "--calls", "2", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), [*args, "--in-flight", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for word in ("admit", "resolve", "record", "egress", "floor", "2 in flight"):
        assert word in result.output
    assert "calls a second" in result.output


@pytest.mark.parametrize(("written", "asked"), [("file", "sqlite"), ("sqlite", "file")])
def test_serve_model_on_a_ledger_of_the_other_layout_is_a_one_line_usage_error(
    tmp_path: Path, written: str, asked: str
) -> None:
    from participants import SqliteCaptureLedger

    directory = tmp_path / "ledger"
    if written == "file":  # a ledger of the file layout is its files
        directory.mkdir()
        (directory / "r.lineage.jsonl").write_bytes(b"")
    else:
        SqliteCaptureLedger(directory).close()
    args = ["serve", "model", "--root", str(tmp_path), "--port", "0", "--ledger-layout", asked]
    result = runner.invoke(build_app(), args, env={"COLUMNS": "200"})
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"open it with the {written} layout" in lines[0]


_SERVER = '[[server]]\nname = "p"\nrole = "model"\nurl = "http://127.0.0.1:1"\n'


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[[server]]\nrole = "model"\nurl = "http://127.0.0.1:1"\n', 'needs name = "..."'),
        ('[[server]]\nname = "p"\nrole = "model"\n', 'needs url = "..."'),
        ('[[server]]\nname = "p"\nrole = "model"\nurl = 7\n', 'needs url = "..."'),
        ('[[server]]\nname = ""\nrole = "model"\nurl = "http://127.0.0.1:1"\n', "needs name"),
        ("server = 5\n", "each under its own [[server]] header"),
        ("server = [1]\n", "each under its own [[server]] header"),
        (_SERVER.replace('"model"', '"policy"'), "unknown role 'policy'"),
        (_SERVER.replace("http://", ""), "url must start with http:// or https://"),
        (_SERVER + _SERVER.replace('"model"', '"agent"'), "two [[server]] tables are named 'p'"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["serve", "model", "--port", "0"]])
def test_a_malformed_cluster_file_is_a_one_line_usage_error(
    tmp_path: Path, text: str, says: str, command: list[str]
) -> None:
    # A missing key was a KeyError traceback, and serve gave one for every malformed file (D363).
    path = tmp_path / "cluster.toml"
    path.write_text(f'root = "{tmp_path}"\n{text}')
    env = {"COLUMNS": "200", "MIDFLIGHT_CONTROL_TOKEN": "t"}
    result = runner.invoke(build_app(), [*command, "--cluster", str(path)], env=env)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert says in lines[0] and str(path) in lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["bench", "checkpoint", "--sizes", "abc"], "got 'abc'"),
        (["bench", "restore", "--sizes", "1,,2"], "got '1,,2'"),
        (["bench", "scale", "--ladder", "x"], "Invalid value for --ladder"),
        (["demo", "--dir", "{file}"], "Not a directory"),
        (["forget", "--cluster", "{cluster}", "bad id"], "invalid rollout id 'bad id'"),
        (["forget", "--cluster", "{cluster}", "r-a1"], "reserved for capture keys"),
    ],
)
def test_bad_values_are_one_line_usage_errors_before_any_work(
    tmp_path: Path, args: list[str], says: str
) -> None:
    # Each was a traceback, or (forget) a connection attempt to every server first.
    (tmp_path / "file").write_text("")
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'root = "{tmp_path}"\n{_SERVER}')
    args = [a.format(file=tmp_path / "file", cluster=cluster) for a in args]
    env = {"COLUMNS": "200", "MIDFLIGHT_CONTROL_TOKEN": "t"}
    result = runner.invoke(build_app(), args, env=env)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and says in lines[0]


@pytest.mark.parametrize("role", ["worker", "model", "resources", "agent", "environment"])
@pytest.mark.parametrize(
    ("under", "says"), [("", "is not a directory"), ("sub", "Not a directory")]
)
def test_serve_on_a_run_root_that_cannot_be_a_directory_is_a_usage_error(
    tmp_path: Path, role: str, under: str, says: str
) -> None:
    # The model server's ledger directory was a NotADirectoryError traceback (D364).
    root = tmp_path / "file"
    root.write_text("")
    args = ["serve", role, "--root", str(root / under), "--port", "0"]
    result = runner.invoke(build_app(), args, env={"COLUMNS": "200"})
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: run root ") and says in lines[0]


def test_model_tiny_replaces_only_a_tiny_model_and_refuses_the_rest_untouched(
    tmp_path: Path,
) -> None:
    # `model tiny DIR` replaced whatever DIR was, a file or a directory of other files (D368).
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "data").write_text("mine too")
    (tmp_path / "link").symlink_to(tmp_path / "work")
    unwritable = "/proc/midflight-model"  # its parent refuses a new directory, even to root
    cases = {
        str(tmp_path / "notes.txt"): "is not a directory",
        str(tmp_path / "work"): "no tiny model",
        str(tmp_path / "link"): "is not a directory",
        unwritable: "cannot be written there",
    }
    for directory, says in cases.items():
        result = runner.invoke(build_app(), ["model", "tiny", directory], env={"COLUMNS": "200"})
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "work" / "data").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "notes.txt", "work"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["bench", "scale", "--ladder", "10", "--out", "{file}"], "{file} is not a directory"),
        (
            ["bench", "checkpoint", "--sizes", "10", "--out", "{file}/x"],
            "{file} is not a directory",
        ),
        (["bench", "restore", "--sizes", "10", "--out", "/proc/midflight"], "cannot be written"),
        (["bench", "checkpoint", "--sizes", "10", "--dir", "{file}"], "no scratch directory"),
        (["bench", "ledger", "--dir", "{file}"], "no scratch directory"),
        (["bench", "hotpath", "--dir", "/proc"], "no scratch directory"),
        (["bench", "overhead", "--dir", "{file}"], "no scratch directory"),
        (["bench", "tracing", "--dir", "{file}"], "no scratch directory"),
        (["bench", "checkpoint", "--sizes", "10", "--profile", "{file}/p.html"], "not a directory"),
        (["bench", "checkpoint", "--sizes", "10", "--profile", "p.txt"], "name the HTML file"),
        (["bench", "restore", "--sizes", "10", "--profile", "{dir}"], "is a directory"),
    ],
)
def test_a_bench_refuses_a_place_it_cannot_write_before_it_measures(
    tmp_path: Path, args: list[str], says: str
) -> None:
    # Each was a traceback; --out and --profile only after the whole run had been measured (D370).
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file", dir=tmp_path) for a in args]
    says = says.format(file=tmp_path / "file")
    result = runner.invoke(build_app(), args, env={"COLUMNS": "200"})
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing measured or written
