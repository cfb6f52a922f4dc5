"""Several OS processes on one ledger directory: concurrent writes, retirement, SIGKILL, stress."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from participants import FileCaptureLedger, SqliteCaptureLedger
from protocols import RolloutRetiredError

from .ledger_factory import commit

pytestmark = pytest.mark.process
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
LAYOUTS = ["file", "sqlite"]


def open_ledger(directory: Path, layout: str) -> FileCaptureLedger | SqliteCaptureLedger:
    return SqliteCaptureLedger(directory) if layout == "sqlite" else FileCaptureLedger(directory)


def ledgers_on_disk(directory: Path, layout: str) -> dict[str, list[dict[str, Any]]]:
    """Every ledger as stored, read without the ledger's code: key → rows in commit order."""
    if layout == "file":
        return {
            path.name.removesuffix(".lineage.jsonl"): [
                json.loads(line)
                for line in path.read_bytes().splitlines()  # every line whole
            ]
            for path in sorted(directory.glob("*.lineage.jsonl"))
        }
    found: dict[str, list[dict[str, Any]]] = {}
    with contextlib.closing(sqlite3.connect(directory / "ledger.sqlite3")) as conn:
        for key, line in conn.execute("SELECT key, line FROM rows ORDER BY seq"):
            found.setdefault(key, []).append(json.loads(line))
    return found


def fences_on_disk(directory: Path, layout: str) -> set[str]:
    if layout == "file":
        return {
            p.name.removesuffix(".lineage.retired") for p in directory.glob("*.lineage.retired")
        }
    with contextlib.closing(sqlite3.connect(directory / "ledger.sqlite3")) as conn:
        return {key for (key,) in conn.execute("SELECT key FROM marks WHERE fenced = 1")}


class Worker:
    """One ``ledger_worker`` child in its own process group, its stdout read by a thread."""

    def __init__(
        self, directory: Path, name: str, events: queue.Queue[tuple[str, str]], layout: str
    ) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.participants.ledger_worker", str(directory), layout],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._events = events
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._events.put((self.name, line.strip()))

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def stop(self, *, kill: bool = False) -> None:
        if kill:
            with contextlib.suppress(ProcessLookupError):  # its whole group is gone already
                os.killpg(self.process.pid, signal.SIGKILL)
        elif self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.send("quit")
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


def expect(events: queue.Queue[tuple[str, str]], who: str, prefix: str) -> str:
    """The next line of ``who``, which must start with ``prefix``."""
    name, line = events.get(timeout=DEADLINE_S)
    assert (name, line.split(" ")[0]) == (who, prefix), (name, line)
    return line


def start(
    directory: Path, names: list[str], layout: str
) -> tuple[list[Worker], queue.Queue[tuple[str, str]]]:
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    workers: list[Worker] = []
    try:
        workers.extend(Worker(directory, name, events, layout) for name in names)
        ready = sorted(events.get(timeout=DEADLINE_S) for _ in workers)
        assert ready == sorted((name, "ready") for name in names)
    except BaseException:
        for worker in workers:  # the ones that did start die with the test, not after it
            worker.stop(kill=True)
        raise
    return workers, events


@pytest.mark.parametrize("layout", LAYOUTS)
def test_several_processes_write_one_directory_concurrently(tmp_path: Path, layout: str) -> None:
    names = ["w0", "w1", "w2"]
    workers, events = start(tmp_path, names, layout)
    keys = [f"k{i}" for i in range(25)]
    try:
        for worker in workers:
            for key in keys:
                worker.send(f"run {key} {worker.name} 4")
        done = [events.get(timeout=DEADLINE_S) for _ in range(len(keys) * len(workers))]
        assert all(line.startswith("done ") for _, line in done)
    finally:
        for worker in workers:
            worker.stop()
    stored = ledgers_on_disk(tmp_path, layout)
    for key in keys:
        calls = [row["model_call_id"] for row in stored[key]]
        assert sorted(calls) == sorted(f"{n}-{t}" for n in names for t in range(4))
        for name in names:  # each writer's calls in its own order
            assert [c for c in calls if c.startswith(name)] == [f"{name}-{t}" for t in range(4)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_processes_that_open_one_new_directory_at_once_all_open_it(
    tmp_path: Path, layout: str
) -> None:
    # Each round, three processes are told together to open the same new directory. SQLite
    # refuses the switch to WAL at once while another process writes the new file: before D431,
    # one round in about 60 failed here (at rounds 23, 29, 36 and 175 in four runs).
    names = ["w0", "w1", "w2"]
    workers, events = start(tmp_path / "own", names, layout)
    try:
        for round_ in range(200):
            directory = tmp_path / f"new-{round_}"
            for worker in workers:
                worker.send(f"open {directory}")
            answers = sorted(events.get(timeout=DEADLINE_S) for _ in workers)
            assert answers == [(name, "opened") for name in names], (round_, answers)
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_retirement_is_seen_by_every_process(tmp_path: Path, layout: str) -> None:
    names = ["w0", "w1", "w2"]
    workers, events = start(tmp_path, names, layout)
    keys = [f"k{i}" for i in range(10)]
    try:
        for worker in workers:  # every process has the rows cached
            for key in keys:
                worker.send(f"run {key} {worker.name} 2")
                expect(events, worker.name, "done")
        ledger = open_ledger(tmp_path, layout)
        result = anyio.run(ledger.retire, keys)
        ledger.close()
        assert result.removed == keys
        for worker in workers:  # late rows from every process are discarded
            for key in keys:
                worker.send(f"run {key} late{worker.name} 2")
                expect(events, worker.name, "done")
                worker.send(f"manifest {key}")
                assert expect(events, worker.name, "retired") == "retired"
    finally:
        for worker in workers:
            worker.stop()
    assert ledgers_on_disk(tmp_path, layout) == {}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sigkill_between_fences_and_deletes_then_a_retry_completes(
    tmp_path: Path, layout: str
) -> None:
    keys = [f"k{i}" for i in range(20)]
    workers, events = start(tmp_path, ["w0"], layout)
    worker = workers[0]
    try:
        for key in keys:
            worker.send(f"run {key} w0 3")
            expect(events, "w0", "done")
        worker.send(f"retire {','.join(keys)} freeze")
        expect(events, "w0", "at")
    finally:
        worker.stop(kill=True)
    assert sorted(ledgers_on_disk(tmp_path, layout)) == sorted(keys)  # before any ledger went
    ledger = open_ledger(tmp_path, layout)
    try:
        if layout == "file":
            assert fences_on_disk(tmp_path, layout) == set(keys)
            with pytest.raises(RolloutRetiredError):  # retired already: the fences are durable
                anyio.run(ledger.manifest, "k0")
        else:  # one transaction: the kill took its fences with it, and nothing changed
            assert fences_on_disk(tmp_path, layout) == set()
            assert len((anyio.run(ledger.manifest, "k0")).records) == 3
        result = anyio.run(ledger.retire, keys)
        assert result.removed == keys and result.absent == []
        anyio.run(ledger.record, commit("k0", 5))
    finally:
        ledger.close()
    assert ledgers_on_disk(tmp_path, layout) == {}


def run_stress(
    directory: Path, *, rollouts: int, batch: int, removal: str, layout: str = "file"
) -> int:
    """Rollouts run by two writer processes; a quarter run again by a third process after their
    batch was removed (retired or deleted) by this one. Returns how many ledgers exist at the end.
    """
    workers, events = start(directory, ["w0", "w1", "dup"], layout)
    by_name = {worker.name: worker for worker in workers}
    keys = [f"r{i}" for i in range(rollouts)]
    duplicated = set(keys[::4])
    ledger = open_ledger(directory, layout)
    try:
        for index, key in enumerate(keys):
            by_name[f"w{index % 2}"].send(f"run {key} first 4")
        pending: list[str] = []
        finished = dups_done = 0
        while finished < rollouts or dups_done < len(duplicated):
            name, line = events.get(timeout=DEADLINE_S)
            assert line.startswith("done "), line
            if name == "dup":
                dups_done += 1
                continue
            finished += 1
            pending.append(line.split()[1])
            if len(pending) == batch or finished == rollouts:
                operation = ledger.retire if removal == "retire" else ledger.delete
                anyio.run(operation, pending)
                for key in pending:
                    if key in duplicated:  # the duplicate writes after the first finished
                        by_name["dup"].send(f"run {key} again 4")
                pending = []
    finally:
        ledger.close()
        for worker in workers:
            worker.stop()
    return len(ledgers_on_disk(directory, layout))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("removal", ["retire", "delete"])
def test_stress_duplicates_never_recreate_retired_ledgers(
    tmp_path: Path, removal: str, layout: str
) -> None:
    left = run_stress(tmp_path, rollouts=160, batch=32, removal=removal, layout=layout)
    if removal == "retire":
        assert left == 0
    else:  # the contrast: without fences every duplicate recreates its ledger
        assert left == 40


@pytest.mark.soak
def test_stress_soak_4000_rollouts(tmp_path: Path) -> None:
    assert run_stress(tmp_path / "retire", rollouts=4000, batch=256, removal="retire") == 0
    assert (
        run_stress(tmp_path / "sqlite", rollouts=4000, batch=256, removal="retire", layout="sqlite")
        == 0
    )


def test_sqlite_sigkill_at_random_moments_loses_no_acknowledged_row(tmp_path: Path) -> None:
    """Two writers SIGKILLed mid-stream, again and again: every row a writer was told is
    durable is there, whole and in its order, and the database opens and takes writes."""
    rng = random.Random(20261202)
    acknowledged: dict[str, int] = {}
    for round_ in range(4):
        workers, events = start(tmp_path, ["w0", "w1"], "sqlite")
        for worker in workers:
            for index in range(200):
                worker.send(f"run {worker.name}-{round_}-{index} {worker.name} 3")
        time.sleep(rng.uniform(0.1, 0.6))
        for worker in workers:
            worker.stop(kill=True)
        while not events.empty():
            _name, line = events.get_nowait()
            if line.startswith("done "):
                acknowledged[line.split()[1]] = 3
    stored = ledgers_on_disk(tmp_path, "sqlite")
    assert acknowledged, "no writer got as far as one rollout before its kill"
    for key, calls in acknowledged.items():
        writer = key.split("-")[0]
        assert [r["model_call_id"] for r in stored[key]] == [f"{writer}-{t}" for t in range(calls)]
    for key, rows in stored.items():  # a key not acknowledged holds a prefix of its calls
        writer = key.split("-")[0]
        assert [r["model_call_id"] for r in rows] == [f"{writer}-{t}" for t in range(len(rows))]
    ledger = open_ledger(tmp_path, "sqlite")
    try:
        anyio.run(ledger.record, commit("after", 0))
        assert len(anyio.run(ledger.manifest, "after").records) == 1
    finally:
        ledger.close()
