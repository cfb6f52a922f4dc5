"""The operator commands on an ``s3://`` checkpoint store (the local S3 server).

``verify``, ``gc`` and ``pin`` take the URL where they take a directory; ``checkpoint`` and
``restore`` find the store in the cluster file's ``checkpoint_store``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator import read_latest
from e2e._cli.app import build_app
from e2e._servers.cluster import Cluster, read_cluster, write_cluster
from protocols import open_store
from tests.coordinator.test_publish import _commit_and_publish, committed

from .test_cmd_control import cli, served
from .test_cmd_retention import run

pytestmark = pytest.mark.anyio


def one_line_usage_error(*args: str) -> str:
    result = CliRunner().invoke(build_app(), list(args))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


async def test_verify_an_s3_checkpoint_and_name_its_tampered_object(s3_root: str) -> None:
    await _commit_and_publish(s3_root, "c1", None)
    location = f"{s3_root}/checkpoints/c1"
    code, payload, _ = run("verify", location, "--json")
    assert code == 0 and payload == {"checkpoint_dir": location, "ok": True, "problems": []}
    store = open_store(s3_root)
    (records,) = [
        o.key for o in store.list_objects("checkpoints/c1/gym/model") if "records-" in o.key
    ]
    store.replace(records, b"{}\n")
    code, payload, _ = run("verify", location + "/", "--json")
    assert code == 1 and not payload["ok"]
    assert any(p.startswith(store.describe(records)) for p in payload["problems"])
    code, _, output = run("verify", location)
    assert code == 1 and "MISMATCH" in output and "s3://" in output
    store.delete(["checkpoints/c1/checkpoint.json"])
    code, payload, _ = run("verify", location, "--json")
    (problem,) = payload["problems"]
    assert code == 1 and "partial commit" in problem


async def test_verify_of_an_s3_url_that_names_no_checkpoint_is_a_one_line_usage_error(
    s3_root: str,
) -> None:
    await _commit_and_publish(s3_root, "c1", None)
    cases = {
        "s3://Not_A_Bucket/x": "not a valid bucket name",
        "s3://midflight/../x": "not a safe key",
        s3_root: "is a run root",
        f"{s3_root}/checkpoints": "holds the checkpoints",
        f"{s3_root}/checkpoints/nope": "is not a checkpoint",
        f"{s3_root}-elsewhere": "is not a checkpoint",
    }
    for location, said in cases.items():
        for extra in ((), ("--json",)):
            line = one_line_usage_error("verify", location, *extra)
            assert said in line and "MISMATCH" not in line, line
    assert f"LATEST is {s3_root}/checkpoints/c1" in one_line_usage_error("verify", s3_root)


async def test_gc_and_pin_on_an_s3_root(s3_root: str) -> None:
    for checkpoint_id in ("c1", "c2", "c3"):
        await _commit_and_publish(s3_root, checkpoint_id, None)
    store = open_store(s3_root)
    code, _, _ = run("pin", s3_root, "c1", "--json")
    assert code == 0 and store.exists("checkpoints/c1/PINNED")
    code, dry, _ = run("gc", s3_root, "--keep", "1", "--dry-run", "--json")
    assert code == 0 and dry["removed"] == ["c2"] and dry["dry_run"]
    assert store.exists("checkpoints/c2/checkpoint.json")
    code, _, output = run("gc", s3_root, "--keep", "1")
    assert code == 0 and "reclaimed" in output
    assert store.subdirectories("checkpoints") == ["c1", "c3"]
    assert store.read("checkpoints/LATEST") == b"c3"
    code, _, _ = run("pin", s3_root, "c1", "--remove", "--json")
    assert code == 0
    code, done, _ = run("gc", s3_root, "--keep", "1", "--json")
    assert done["removed"] == ["c1"] and done["bytes_reclaimed"] > 0
    assert "not a published checkpoint" in one_line_usage_error("pin", s3_root, "nope")
    assert "not a valid bucket name" in one_line_usage_error("pin", "s3://X/y", "c1")


async def test_gc_of_an_s3_url_that_is_no_run_root_is_a_one_line_usage_error(
    s3_root: str,
) -> None:
    await _commit_and_publish(s3_root, "c1", None)
    cases = {
        f"{s3_root}-empty": "nothing is stored there",
        f"{s3_root}/checkpoints": "holds the checkpoints",
        f"{s3_root}/checkpoints/c1": "is one checkpoint",
        "s3://midflight/a b": "not a safe key",
    }
    for root, said in cases.items():
        assert said in one_line_usage_error("gc", root, "--json")


async def test_checkpoint_and_restore_through_the_cluster_files_checkpoint_store(
    tmp_path: Path, s3_root: str
) -> None:
    async with served(tmp_path, checkpoint_store=s3_root) as s:
        assert read_cluster(s.cluster_file).store_root == s3_root
        cluster = ("--cluster", str(s.cluster_file))
        code, out = await cli("checkpoint", *cluster, "--id", "c1")
        assert code == 0 and out["published"], out
        assert out["checkpoint_dir"] == f"{s3_root}/checkpoints/c1"
        latest = read_latest(s3_root)
        assert latest is not None and latest.checkpoint_id == "c1"
        assert not (s.root / "checkpoints").exists()  # nothing of it under the run root
        code, out = await cli("verify", out["checkpoint_dir"])
        assert code == 0 and out["problems"] == []
        code, out = await cli("restore", *cluster)
        assert code == 0 and out["checkpoint_id"] == "c1" and "r1-a1" in out["restored"]
        code, out = await cli("restore", *cluster, "--checkpoint", "nope")
        assert code == 2


async def test_a_malformed_checkpoint_store_is_a_usage_error_and_old_files_still_read(
    tmp_path: Path, s3_root: str
) -> None:
    path = tmp_path / "cluster.toml"
    write_cluster(path, Cluster(tmp_path, ()))
    assert "checkpoint_store" not in path.read_text()  # a file without it is what it always was
    assert read_cluster(path).store_root == tmp_path
    for bad in ('"s3://Not_A_Bucket/x"', '"relative/dir"', "3"):
        path.write_text(f'root = "{tmp_path}"\ncheckpoint_store = {bad}\n')
        with pytest.raises(ValueError, match="checkpoint_store"):
            read_cluster(path)
    line = one_line_usage_error("restore", "--cluster", str(path))
    assert "checkpoint_store" in line
    await committed(s3_root, ["c9"])  # shares only: nothing published there
    write_cluster(path, Cluster(tmp_path, (), s3_root))
    result = CliRunner().invoke(
        build_app(), ["restore", "--cluster", str(path)], env={"MIDFLIGHT_CONTROL_TOKEN": "t"}
    )
    assert result.exit_code == 2 and f"nothing is published under {s3_root}" in result.output


async def test_a_store_failure_names_the_url_once(s3_root: str) -> None:
    """The store's own error already begins with the URL: the line does not say it twice."""
    url = "s3://no-such-bucket/x" + s3_root.removeprefix("s3://midflight")
    for command in (("verify", url), ("gc", url), ("pin", url, "c1", "--remove")):
        line = one_line_usage_error(*command)
        assert line.count(url) == 1 and "404 Not Found" in line, line
