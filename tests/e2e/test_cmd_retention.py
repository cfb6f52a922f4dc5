"""``midflight verify``, ``gc`` and ``pin`` as an operator runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coordinator import LATEST_FILE, checkpoint_directory
from coordinator._retention import PINNED_FILE
from e2e._cli.app import build_app
from tests.coordinator.test_publish import _commit_and_publish

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def run(*args: str) -> tuple[int, Any, str]:
    result = CliRunner().invoke(build_app(), list(args))
    if "--json" in args:
        return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1]), result.output
    return result.exit_code, None, result.output


async def test_verify_exits_non_zero_naming_the_flipped_records_file(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    directory = checkpoint_directory(tmp_path, "c1")
    code, payload, _ = run("verify", str(directory), "--json")
    assert code == 0 and payload["ok"]
    records = sorted(directory.glob("gym/environment/*/records-*.jsonl"))[0]
    records.chmod(0o644)
    data = bytearray(records.read_bytes())
    data[0] ^= 0x20
    records.write_bytes(bytes(data))
    code, payload, _ = run("verify", str(directory), "--json")
    assert code == 1 and not payload["ok"]
    (problem,) = payload["problems"]
    assert str(records) in problem
    code, _, output = run("verify", str(directory))
    assert code == 1 and "MISMATCH" in output


async def test_gc_dry_run_then_gc_then_pin(tmp_path: Path) -> None:
    for checkpoint_id in ("c1", "c2", "c3"):
        await _commit_and_publish(tmp_path, checkpoint_id, None)
    code, _, _ = run("pin", str(tmp_path), "c1", "--json")
    assert code == 0 and (checkpoint_directory(tmp_path, "c1") / PINNED_FILE).exists()
    code, dry, _ = run("gc", str(tmp_path), "--keep", "1", "--dry-run", "--json")
    assert code == 0 and dry["removed"] == ["c2"] and dry["dry_run"]
    assert checkpoint_directory(tmp_path, "c2").exists()
    code, done, output = run("gc", str(tmp_path), "--keep", "1")
    assert code == 0 and "reclaimed" in output
    assert not checkpoint_directory(tmp_path, "c2").exists()
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text() == "c3"
    code, _, _ = run("pin", str(tmp_path), "c1", "--remove", "--json")
    assert code == 0
    code, done, _ = run("gc", str(tmp_path), "--keep", "1", "--json")
    assert done["removed"] == ["c1"] and done["bytes_reclaimed"] > 0
    code, _, output = run("pin", str(tmp_path), "nope")
    assert code == 2 and "not a published checkpoint" in output


def _one_line_usage_error(code: int, output: str) -> str:
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1, output
    assert lines[0].startswith("error: ") and "Traceback" not in output
    return lines[0]


async def test_verify_of_something_that_is_no_checkpoint_is_a_one_line_usage_error(
    tmp_path: Path,
) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {
        tmp_path / "nonexistent": "no such directory",
        tmp_path / "a-file": "not a directory",
        tmp_path: "is a run root",
        tmp_path / "checkpoints": "holds the checkpoints",
        tmp_path / "empty": "is not a checkpoint",
    }
    for directory, said in cases.items():
        for extra in ((), ("--json",)):
            result = CliRunner().invoke(build_app(), ["verify", str(directory), *extra])
            line = _one_line_usage_error(result.exit_code, result.output)
            assert said in line and "MISMATCH" not in line, line
    # a run root names where its newest checkpoint is
    result = CliRunner().invoke(build_app(), ["verify", str(tmp_path)])
    assert str(checkpoint_directory(tmp_path, "c1")) in result.output


async def test_verify_of_a_commit_never_published_is_a_mismatch(tmp_path: Path) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    directory = checkpoint_directory(tmp_path, "c1")
    (directory / "checkpoint.json").unlink()
    code, payload, _ = run("verify", str(directory), "--json")
    assert code == 1 and not payload["ok"]
    (problem,) = payload["problems"]
    assert "partial commit" in problem and "Errno" not in problem


async def test_gc_of_a_missing_root_or_of_a_checkpoint_is_a_one_line_usage_error(
    tmp_path: Path,
) -> None:
    await _commit_and_publish(tmp_path, "c1", None)
    cases = {
        tmp_path / "nonexistent": "no such directory",
        tmp_path / "checkpoints": "holds the checkpoints",
        checkpoint_directory(tmp_path, "c1"): "is one checkpoint",
    }
    for root, said in cases.items():
        result = CliRunner().invoke(build_app(), ["gc", str(root), "--json"])
        assert said in _one_line_usage_error(result.exit_code, result.output)
    fresh = tmp_path / "fresh-run"  # a run root before its first checkpoint: nothing to do
    fresh.mkdir()
    code, report, _ = run("gc", str(fresh), "--json")
    assert code == 0 and report["removed"] == []


async def test_pin_says_what_it_changed_and_refuses_a_root_that_is_not_one(
    tmp_path: Path,
) -> None:
    """D367: a second pin or an unpin of nothing changes nothing and says so; a mistyped root is
    a usage error for pin and unpin alike, as it is for gc."""
    await _commit_and_publish(tmp_path, "c1", None)
    said = []
    for args in (("c1",), ("c1",), ("c1", "--remove"), ("c1", "--remove")):
        code, payload, _ = run("pin", str(tmp_path), *args, "--json")
        assert code == 0
        said.append(payload["changed"])
    assert said == [True, False, True, False]
    assert not (checkpoint_directory(tmp_path, "c1") / PINNED_FILE).exists()
    code, _, output = run("pin", str(tmp_path), "c1", "--remove")
    assert code == 0 and output.strip() == "c1: was not pinned"
    run("pin", str(tmp_path), "c1")
    code, _, output = run("pin", str(tmp_path), "c1")
    assert code == 0 and output.strip() == "c1: already pinned"
    for root, why in (
        (tmp_path / "nowhere", "no such directory"),
        (tmp_path / "checkpoints", "holds the checkpoints"),
        (checkpoint_directory(tmp_path, "c1"), "is one checkpoint"),
    ):
        for extra in ((), ("--remove",)):
            code, _, output = run("pin", str(root), "c1", *extra)
            assert why in _one_line_usage_error(code, output)
    assert (checkpoint_directory(tmp_path, "c1") / PINNED_FILE).exists()  # none of them unpinned
