"""The floors of ``bench ledger``: each operation's bare system calls, and the thread round trip.

``_Floor`` does the file layout's system calls on the same names; ``_LogFloor`` is the SQLite
layout's (one append-only log, one fsync per commit, D341); ``_ThreadHop`` is the least a call
pays to run blocking work off the event loop and come back (D189, D260); ``wake_probe`` measures
that round trip with the thread pinned beside the event loop's CPU and away from it (D444).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path


class _Floor:
    """The bare system calls of each operation on the same names, in its own directory."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.prefix = f"{root}{os.sep}"
        self.root = root
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)

    def record_row(self, key: str, line: bytes, *, first: bool) -> None:
        """One row of ``record``: open, write, fsync, close; the directory too for a new file."""
        fd = os.open(
            f"{self.prefix}{key}.lineage.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644
        )
        os.write(fd, line)
        os.fsync(fd)
        os.close(fd)
        if first:
            os.fsync(self.dir_fd)

    def record(self, lines: dict[str, list[bytes]]) -> None:
        for key, rows in lines.items():
            for index, line in enumerate(rows):
                self.record_row(key, line, first=index == 0)

    def record_concurrent(
        self, pool: ThreadPoolExecutor, shards: dict[int, list[str]], lines: dict[str, list[bytes]]
    ) -> None:
        """``record`` from one thread per shard, as the ledger's group commit spreads the work.

        Each thread appends call 0 of each of its rollouts, then call 1, and so on: the same
        system calls in the same order as the shard thread of the ledger it stands beside.
        """

        def shard_work(keys: list[str]) -> None:
            for turn in range(len(lines[keys[0]])):
                for key in keys:
                    path = f"{self.prefix}{key}.lineage.jsonl"
                    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
                    os.write(fd, lines[key][turn])
                    os.fsync(fd)
                    os.close(fd)
                    if turn == 0:
                        os.fsync(self.dir_fd)

        for done in [pool.submit(shard_work, keys) for keys in shards.values()]:
            done.result()

    def manifest(self, keys: list[str]) -> None:
        for key in keys:
            os.path.exists(f"{self.prefix}{key}.lineage.retired")
            fd = os.open(f"{self.prefix}{key}.lineage.jsonl", os.O_RDONLY)
            os.read(fd, 1 << 20)
            os.close(fd)

    def retire(self, batches: list[list[str]]) -> None:
        for batch in batches:
            for key in batch:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
                os.close(os.open(f"{self.prefix}{key}.lineage.retired", flags, 0o644))
            os.fsync(self.dir_fd)
            for key in batch:
                os.unlink(f"{self.prefix}{key}.lineage.jsonl")
            os.fsync(self.dir_fd)

    def delete(self, batches: list[list[str]]) -> None:
        for batch in batches:
            for key in batch:
                for suffix in (".lineage.jsonl", ".lineage.retired", ".lineage.started"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{self.prefix}{key}{suffix}")
            os.fsync(self.dir_fd)

    def import_rows_many(self, batches: list[dict[str, bytes]]) -> None:
        for batch in batches:
            os.listdir(self.root)
            for key, data in batch.items():
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                fd = os.open(f"{self.prefix}{key}.lineage.jsonl", flags, 0o644)
                os.write(fd, data)
                os.close(fd)
            os.fsync(self.dir_fd)

    def close(self) -> None:
        os.close(self.dir_fd)


class _LogFloor:
    """The SQLite layout's floor: the same bytes appended to one log, one fsync per commit."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(root / "floor.log", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(self.dir_fd)  # the log's name, once
        self.end = 0
        self.where: dict[str, tuple[int, int]] = {}

    def _commit(self, data: bytes, keys: list[str] | None = None) -> None:
        os.write(self.fd, data)
        os.fsync(self.fd)
        if keys is not None and len(keys) == 1:
            start, length = self.where.get(keys[0], (self.end, 0))
            self.where[keys[0]] = (start, length + len(data))
        self.end += len(data)

    def record_row(self, key: str, line: bytes, *, first: bool) -> None:
        del first  # no file per rollout: nothing to create
        self._commit(line, [key])

    def record(self, lines: dict[str, list[bytes]]) -> None:
        for key, rows in lines.items():
            for line in rows:
                self.record_row(key, line, first=False)

    def record_concurrent(self, lines: dict[str, list[bytes]]) -> None:
        """Call 0 of every rollout in flight in one commit, then call 1, and so on."""
        for turn in range(len(next(iter(lines.values())))):
            self._commit(b"".join(rows[turn] for rows in lines.values()))

    def manifest(self, keys: list[str]) -> None:
        for key in keys:
            start, length = self.where.get(key, (0, 0))
            os.pread(self.fd, length, start)

    def retire(self, batches: list[list[str]]) -> None:
        for batch in batches:
            self._commit("".join(f"R {key}\n" for key in batch).encode())

    def delete(self, batches: list[list[str]]) -> None:
        for batch in batches:
            self._commit("".join(f"D {key}\n" for key in batch).encode())

    def import_rows_many(self, batches: list[dict[str, bytes]]) -> None:
        for batch in batches:
            self._commit(b"".join(batch.values()))

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.dir_fd)


class _ThreadHop:
    """The least a call can pay to run blocking work off the event loop and come back.

    One thread fed by a ``queue.SimpleQueue`` and ``call_soon_threadsafe`` back to the caller's
    loop, the mechanism of the ledger's group commit with nothing else: no lock, no shard
    choice, no cancellation shield. Used as a context manager; the thread stops on exit.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], asyncio.Future[None]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="bench-hop", daemon=True)

    def __enter__(self) -> _ThreadHop:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._jobs.put(None)
        self._thread.join(30.0)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, future = job
            error: BaseException | None = None
            try:
                work()
            except BaseException as exc:  # handed to the awaiting caller, like a worker call
                error = exc
            future.get_loop().call_soon_threadsafe(_settle, future, error)

    async def run(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the hop thread and wait for it (re-raising what it raised)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._jobs.put((work, future))
        await future


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _plant(root: Path, data: dict[str, bytes]) -> None:
    """Untimed setup: live ledgers to delete."""
    for key, content in data.items():
        (root / f"{key}.lineage.jsonl").write_bytes(content)


WAKE_PROBE_ROUNDS = 400
"""Round trips per placement in :func:`wake_probe`."""


def wake_probe(rounds: int = WAKE_PROBE_ROUNDS) -> dict[str, float] | None:
    """What one bare event loop -> thread -> event loop round trip costs on this machine, by
    where the thread runs: the median µs with it on the event loop's CPU (``same_cpu_us``) and
    on another CPU (``other_cpu_us``).

    On this project's 2-core VM the second is about six times the first (D444): waking a
    sleeping CPU costs tens of µs each way. The kernel chooses the placement of the ledger's
    threads and of the floor's, so a ``ratio_to_floor_via_thread`` can move between runs by
    that difference; this says how large it is. The probe runs on threads of its own, pinned;
    the bench's threads are not. ``None`` where a thread cannot be pinned or there is one CPU.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    found: dict[str, float] = {}

    async def measure() -> None:
        os.sched_setaffinity(0, {cpus[0]})  # this thread's loop, on the first CPU
        for name, cpu in (("same_cpu_us", cpus[0]), ("other_cpu_us", cpus[1])):
            with _ThreadHop() as hop:
                await hop.run(partial(os.sched_setaffinity, 0, {cpu}))
                times = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    await hop.run(_nothing)
                    times.append(time.perf_counter() - start)
            found[name] = round(statistics.median(times) * 1e6, 1)

    def run() -> None:
        with contextlib.suppress(OSError):  # a CPU set the process may not use: no figures
            asyncio.run(measure())

    probe = threading.Thread(target=run, name="bench-wake-probe", daemon=True)
    probe.start()
    probe.join(60.0)
    return found if len(found) == 2 else None


def _nothing() -> None:
    return None
