"""``midflight drill``'s options, refused before anything starts when they cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from e2e._cli.app import build_app


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal comes before anything starts: running anything fails the test at once."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the drill started")

    for name in (
        "e2e._cli.drill.run_drill",
        "e2e._cli.drill_matrix.run_matrix",
        "e2e._cli.drill_sequences.run_sequences",
    ):
        monkeypatch.setattr(name, ran)


def _refused(*args: str) -> str:
    result = CliRunner().invoke(build_app(), ["drill", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--checkpoints", "1"], "can never pass"),
        (["--checkpoints", "2"], "can never pass"),
        (["--crashes", "0"], "can never pass"),
        (["--crashes", "1", "--checkpoints", "5"], "can never pass"),
        (["--crashes", "4", "--checkpoints", "3"], "fewer than --crashes"),
    ],
)
def test_options_the_minimum_activity_rule_always_fails_are_usage_errors(
    args: list[str], said: str, tmp_path: Path
) -> None:
    keep = tmp_path / "never-written"
    for extra in ((), ("--json",)):
        assert said in _refused(*args, "--keep-dir", str(keep), *extra)
    assert not keep.exists()  # refused before anything ran


def test_a_used_keep_dir_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "evidence.jsonl").write_text("{}\n")
    for extra in ((), ("--json",), ("--matrix", "small"), ("--sequences", "1")):
        assert "is not empty" in _refused("--keep-dir", str(tmp_path), *extra)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    a_file = tmp_path / "run" / "evidence.jsonl"
    assert "not a directory" in _refused("--keep-dir", str(a_file))


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--fault", "nope"], "unknown fault"),
        (["--verify", "nope"], "unknown verify mode"),
        (["--resources-mode", "nope"], "unknown resources mode"),
        (["--sequence-case", "nope"], "unknown sequence case"),
        (["--matrix", "nope"], "--matrix"),
    ],
)
def test_unknown_names_are_one_line_usage_errors(args: list[str], said: str) -> None:
    assert said in _refused(*args)


@pytest.mark.parametrize("flag", ["--processes", "--workers"])
def test_processes_and_its_older_name_workers_run_the_same_drill(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[object] = []

    def run_drill(options: object, *args: object, **kwargs: object) -> None:
        ran.append(options)
        raise typer.Exit(0)

    monkeypatch.setattr("e2e._cli.drill.run_drill", run_drill)
    args = ["drill", flag, "2", "--json", "--keep-dir", str(tmp_path / "run")]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    assert [getattr(options, "processes", None) for options in ran] == [2]
