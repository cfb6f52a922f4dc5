"""``midflight bench restore`` at a tiny size, and the crash-restore cycle it shares with scale."""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from coordinator import read_latest
from e2e import build_app
from e2e._bench.checkpoint import PARKED_WORKLOAD
from e2e._bench.common import InProcessCluster
from e2e._bench.crashed_cluster import park_and_crash
from e2e._bench.restore import (
    FLOOR_SAMPLES,
    crash_restore_cycle,
    read_and_write_floor,
    sampled_floor,
)
from e2e._bench.server_seconds import seconds_in
from participants import ControlTelemetry, live_ledger_keys

runner = CliRunner()


def test_bench_restore_restores_every_parked_rollout_beside_its_floor(tmp_path: Path) -> None:
    result = runner.invoke(
        build_app(),
        ["bench", "restore", "--sizes", "3", "--json", "--dir", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    (row,) = payload["rows"]
    assert row["rollouts"] == row["parked"] == row["restored"] == 3
    assert row["records_bytes"] > 0 and row["checkpoint_bytes"] >= row["records_bytes"]
    assert row["restore_s"] > 0 and row["floor_s"] > 0 and row["ratio"] > 0
    assert row["us_per_rollout"] == round(row["restore_s"] / 3 * 1e6, 1)
    assert row["retired"] == 1 and row["retire_s"] > 0  # a quarter of 3, at least one (D389)
    # Each participant server's own restore, read from its /metrics, inside the wall (D453).
    own = row["server_restore_s"]
    assert set(own) == {"environment", "policy", "agent", "resources"}
    assert all(0 < seconds <= row["restore_s"] for seconds in own.values()), own
    assert "each server's own restore" not in result.stdout  # JSON only
    assert "read every file" in payload["floor"]
    # The floor is the median of its samples, each one reported (D445).
    samples = row["floor_samples_s"]
    assert len(samples) == FLOOR_SAMPLES and all(sample > 0 for sample in samples)
    assert row["floor_s"] == pytest.approx(statistics.median(samples), abs=2e-6)


def test_bench_restore_reports_the_slope_between_sizes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = ["bench", "restore", "--sizes", "2,3", "--json", "--dir", str(tmp_path)]
    result = runner.invoke(build_app(), [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    # --out writes the JSON and its picture, which `bench plot` draws again from the JSON.
    assert payload["written"] == [str(out / "restore.json"), str(out / "restore.png")]
    redrawn = runner.invoke(
        build_app(), ["bench", "plot", str(out / "restore.json"), "--out", str(tmp_path / "r.png")]
    )
    assert redrawn.exit_code == 0, redrawn.output
    assert (tmp_path / "r.png").read_bytes() == (out / "restore.png").read_bytes()
    small, large = payload["rows"]
    slope, retire_slope = payload["slopes"]
    assert (slope["figure"], slope["from"], slope["to"]) == ("restore_s", 2, 3)
    assert (retire_slope["figure"], retire_slope["from"], retire_slope["to"]) == ("retire_s", 2, 3)
    added = round((large["restore_s"] - small["restore_s"]) * 1e6, 1)
    assert slope["us_per_added_rollout"] == large["slope_us_per_added_rollout"] == added
    assert small["slope_us_per_added_rollout"] is None
    for key in ("rollouts", "restore_s", "floor_s", "ratio", "us_per_rollout"):
        assert key in small and key in large
    table = runner.invoke(
        build_app(), ["bench", "restore", "--sizes", "2,3", "--dir", str(tmp_path)]
    )
    assert table.exit_code == 0, table.output
    assert "slope of restore_s from 2 to 3 rollouts" in table.stdout
    assert "slope of retire_s from 2 to 3 rollouts" in table.stdout


@pytest.mark.anyio
async def test_the_crashed_cluster_is_gone_before_the_restore_is_timed(tmp_path: Path) -> None:
    alive: list[int] = []

    @contextmanager
    def census() -> Iterator[None]:
        # type(), not isinstance(): isinstance reads __class__, which some of torch's deprecated
        # module attributes answer with a FutureWarning (an error under this suite's filters).
        alive.append(sum(type(o) is InProcessCluster for o in gc.get_objects()))
        yield

    gc.disable()  # nothing collected: a cluster parked in this process would still be here
    try:
        await crash_restore_cycle(tmp_path, 2, finish=False, profiler=census)
    finally:
        gc.enable()
    assert alive == [1]  # only the fresh cluster: the crashed one lived in its own process


@pytest.mark.anyio
async def test_the_restored_cluster_was_parked_in_a_process_that_was_sigkilled(
    tmp_path: Path,
) -> None:
    """D376: a restore runs in a process that served nothing, as every real restore does (D19),
    after a real SIGKILL of the process that parked and checkpointed the rollouts."""
    crashed = await park_and_crash(tmp_path / "run", 2, PARKED_WORKLOAD)
    assert crashed.pid != os.getpid() and crashed.returncode == -signal.SIGKILL
    assert crashed.taken["parked"] == 2 and crashed.park_s > 0
    with pytest.raises(ProcessLookupError):
        os.kill(crashed.pid, 0)  # gone, and reaped
    assert read_latest(tmp_path / "run") is not None  # what it published survives it


@pytest.mark.anyio
async def test_the_parked_cluster_logs_only_warnings_so_the_bench_display_stays_clean(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The child's servers log as the bench's own process does (warnings and errors on
    stderr): its info lines would run through the progress display of every restore bench."""
    await park_and_crash(tmp_path / "run", 2, PARKED_WORKLOAD)
    out, err = capfd.readouterr()
    assert "checkpoint.prepare" not in err and "[info" not in err, err[-2000:]
    assert out == ""  # the figures travel on the child's own pipe, never on the bench's stdout


def _commands_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:  # it ended while we looked
                continue
    return found


@pytest.mark.anyio
async def test_a_restore_into_a_process_per_server_runs_on_real_servers_gone_after(
    tmp_path: Path,
) -> None:
    """D447: with ``servers="processes"`` each participant restores in a server process of its
    own, which logs its restore to its own file, and every one is gone when the cycle ends."""
    row = await crash_restore_cycle(tmp_path, 3, finish=False, servers="processes")
    assert row["servers"] == "processes"
    assert row["restored"] == 3 and row["retired"] == 1 and row["restore_s"] > 0
    own = row["server_restore_s"]  # read from each server process's /metrics (D453)
    assert set(own) == {"environment", "policy", "agent", "resources"}, own
    assert all(0 < seconds <= row["restore_s"] for seconds in own.values()), own
    logs = tmp_path / "run" / "logs"
    restored_in = {
        path.name for path in logs.glob("*-0.log") if "checkpoint.restore" in path.read_text()
    }
    assert restored_in == {"policy-0.log", "resources-0.log", "agent-0.log", "environment-0.log"}
    assert _commands_naming(str(tmp_path / "run" / "cluster.toml")) == []


@pytest.mark.anyio
async def test_servers_in_processes_cannot_finish_the_rollouts(tmp_path: Path) -> None:
    # Finishing needs a connection per rollout on every hop: the suites' reason to park in
    # one process (D201). Refused before anything is parked.
    with pytest.raises(ValueError, match="servers='processes' with finish=True"):
        await crash_restore_cycle(tmp_path, 2, finish=True, servers="processes")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.anyio
async def test_every_restored_rollout_finishes_after_the_crash(tmp_path: Path) -> None:
    row = await crash_restore_cycle(tmp_path, 4, finish=True)
    assert (row["parked"], row["restored"], row["finished"], row["lost"]) == (4, 4, 4, 0)
    # The fresh cluster continued the rollouts as attempt 1: the ledger holds their rows.
    live = set(live_ledger_keys(tmp_path / "run" / "ledger"))
    assert {f"r{i:06d}-a1" for i in range(4)} <= live


def test_the_restore_floor_reads_and_writes_every_byte(tmp_path: Path) -> None:
    source = tmp_path / "checkpoint"
    (source / "gym").mkdir(parents=True)
    (source / "gym" / "records-x.jsonl").write_bytes(b"a" * 1000)
    (source / "checkpoint.json").write_bytes(b"{}")
    seconds, files, size = read_and_write_floor(source, tmp_path / "floor")
    assert (files, size) == (2, 1002) and seconds > 0
    written = sorted(p.read_bytes() for p in (tmp_path / "floor").iterdir())
    assert written == [b"a" * 1000, b"{}"]


def test_each_floor_sample_writes_every_byte_into_a_directory_removed_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "records-x.jsonl").write_bytes(b"a" * 1000)
    seen: list[list[str]] = []
    real = read_and_write_floor

    def watched(directory: Path, into: Path) -> tuple[float, int, int]:
        seen.append(sorted(p.name for p in (tmp_path / "floor").glob("*")))  # before this one
        taken = real(directory, into)
        assert [p.read_bytes() for p in into.iterdir()] == [b"a" * 1000]
        return taken

    monkeypatch.setattr("e2e._bench.restore.read_and_write_floor", watched)
    seconds, files, size = sampled_floor(source, tmp_path / "floor", samples=3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds) and (files, size) == (1, 1000)
    # No copy is left beside the next one: each sample writes into room the last one freed.
    assert seen == [[], [], []]
    assert list((tmp_path / "floor").iterdir()) == []


def test_a_servers_restore_seconds_are_its_restores_of_every_outcome_and_nothing_else() -> None:
    """D453 reads the histogram every participant server keeps, as Prometheus would."""
    telemetry = ControlTelemetry("model", "policy")
    telemetry.operation("restore", outcome="ok", seconds=0.25)
    telemetry.operation("restore", outcome="refused", seconds=0.125, code="checkpoint_conflict")
    telemetry.operation("commit", outcome="ok", seconds=4.0)
    telemetry.operation("resume", outcome="ok", seconds=8.0)
    text = generate_latest(telemetry.registry).decode()
    assert seconds_in(text, "restore") == 0.375
    assert seconds_in(text, "commit") == 4.0
    assert seconds_in(text, "retire") == 0.0
