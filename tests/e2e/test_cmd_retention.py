"""``midflight verify``, ``gc`` and ``pin`` as an operator runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coordinator import LATEST_FILE, PINNED_FILE, checkpoint_directory
from e2e._cli import build_app
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
