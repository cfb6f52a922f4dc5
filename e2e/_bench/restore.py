"""The restore benchmark, and the crash-restore cycle the scale suite reuses.

A cycle parks N rollouts on an in-process cluster in a child process, takes one published
checkpoint, and crashes: the child is SIGKILLed (its rollouts cancelled, nothing retired or
drained), and a fresh cluster starts on the same run root in the bench's own process, which has
served nothing, as a restore's processes always have (D19, D376); with ``servers="processes"``
it starts as a process per server instead (D447). The controller reads ``LATEST`` and restores
every continued episode; the time from sending restore to resume returning is ``restore_s``.
The floor reads the checkpoint's files and writes the same bytes elsewhere, one fsync per file;
it is taken ``FLOOR_SAMPLES`` times, each copy removed before the next, and ``floor_s`` is the
median (``floor_samples_s`` holds each, D445); ``ratio`` = ``restore_s / floor_s``;
``us_per_rollout`` is ``restore_s`` per rollout, and the suite adds the slope between sizes.

Then, as a controller does after every restore, it retires the attempts it logged and did not
continue (``retired``: a quarter as many as the rollouts, of rollouts the checkpoint never held) in
one request, while every restored rollout is still pending: ``retire_s``, and the suite adds its
slope between sizes too. Each participant checks that batch against everything it holds, so a
retire that went attempt by attempt grew with the product of the two (D389).

With ``finish=True`` the cycle then runs every restored rollout to its end as attempt 1 and
counts what came back: ``lost`` is the rollouts in flight at the checkpoint that did not finish
with a result, for any reason (not exported, not restored, failed).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Final

import anyio

from coordinator import checkpoint_directory, read_latest
from protocols import EpisodeId

from .checkpoint import PARKED_WORKLOAD
from .common import PARKING, InProcessCluster, Workload, files_under, median, ratio, stage
from .common import write_floor as write_same_bytes
from .crashed_cluster import park_and_crash
from .growth import add_growth, slopes, us_per_rollout
from .process_cluster import ProcessCluster
from .restore_servers import RestoreServers
from .server_seconds import server_seconds

SIZES: Final = (100, 1000, 4000)
RESTORED_WORKLOAD: Final = Workload(activations=2, turns=1, max_tokens=128, token_delay_ms=0.0)
"""After the crash the worker is fast, so a finishing run does not wait on the parked pace."""
DEADLINE_SECONDS: Final = 600.0
"""A restore or resume deadline: the control plane's horizon caps what a call may carry."""


FLOOR_SAMPLES: Final = 5
"""Floor samples per cycle (D445). The first copy of a checkpoint's bytes waits for pages the
kernel must find, and later copies reuse the pages of the one removed before them: eight in a
row of a 16,000-rollout checkpoint took 0.103 s falling to 0.043 s. One sample read as whichever
it happened to be; the median of five is the settled cost."""


def sampled_floor(
    directory: Path, into: Path, samples: int = FLOOR_SAMPLES
) -> tuple[list[float], int, int]:
    """:func:`read_and_write_floor` ``samples`` times, each into a directory of its own under
    ``into`` that is removed before the next. Returns (seconds of each, files, bytes)."""
    seconds: list[float] = []
    files = size = 0
    for index in range(samples):
        target = into / str(index)
        taken, files, size = read_and_write_floor(directory, target)
        seconds.append(taken)
        shutil.rmtree(target)
    return seconds, files, size


def read_and_write_floor(directory: Path, into: Path) -> tuple[float, int, int]:
    """The floor of a restore: read every file of the checkpoint, write the same bytes (one
    fsync per file). Returns (seconds, files, bytes)."""
    started = time.perf_counter()
    files = {str(path): path.read_bytes() for path in files_under(directory)}
    read_s = time.perf_counter() - started
    return read_s + write_same_bytes(files, into), len(files), sum(map(len, files.values()))


def records_bytes(directory: Path) -> int:
    """Bytes of the participants' records files in a checkpoint."""
    return sum(path.stat().st_size for path in directory.rglob("records-*.jsonl"))


async def crash_restore_cycle(
    root: Path,
    rollouts: int,
    *,
    finish: bool,
    parked: Workload = PARKED_WORKLOAD,
    restored: Workload = RESTORED_WORKLOAD,
    profiler: Callable[[], AbstractContextManager[Any]] | None = None,
    servers: str = "in-process",
) -> dict[str, Any]:
    """Park, checkpoint, crash, restore (and optionally finish) ``rollouts`` rollouts.

    ``servers`` is where the restore runs: ``in-process`` (this process) or ``processes`` (a
    process per server, D447; without ``finish``, which needs a connection per rollout).

    Raises:
        ValueError: ``servers`` is unknown, or ``processes`` with ``finish``.
    """
    if servers not in tuple(RestoreServers) or (servers == RestoreServers.processes and finish):
        raise ValueError(f"cannot restore on servers={servers!r} with finish={finish}")
    run_root = root / "run"
    episodes = [EpisodeId(rollout_id=f"r{i:06d}", attempt=0) for i in range(rollouts)]
    who = f"{rollouts:,} rollouts"
    crashed = await park_and_crash(run_root, rollouts, parked)
    park_s, taken = crashed.park_s, crashed.taken
    latest = read_latest(run_root)
    if latest is None:
        raise RuntimeError("the checkpoint before the crash was not published")
    directory = checkpoint_directory(run_root, latest.checkpoint_id)
    continued = list(latest.continued)
    second: InProcessCluster | ProcessCluster = (
        ProcessCluster(run_root, restored)
        if servers == RestoreServers.processes
        else InProcessCluster(run_root, restored)
    )
    results: list[dict[str, Any]] = []
    async with second.running():
        coordinator = second.coordinator
        assert coordinator is not None
        stage(f"{who} · restoring")
        with (profiler or nullcontext)():
            begun = time.perf_counter()
            replies = await coordinator.restore(
                "restore-1", time.time() + DEADLINE_SECONDS, str(directory), continued
            )
            await coordinator.resume("restore-1", time.time() + DEADLINE_SECONDS)
            restore_s = time.perf_counter() - begun
        # Outside the timed span: which participant the restore waited for (D453).
        by_server = await server_seconds(coordinator.members, "restore", second.transport_of)
        others = [EpisodeId(rollout_id=f"x{i:06d}") for i in range(max(1, rollouts // 4))]
        stage(f"{who} · retiring the attempts it did not continue ({len(others):,})")
        begun = time.perf_counter()
        await coordinator.retire("retire-1", time.time() + DEADLINE_SECONDS, others)
        retire_s = time.perf_counter() - begun
        forgotten = [episode.rollout_id for episode in others]
        await coordinator.forget("forget-1", time.time() + DEADLINE_SECONDS, forgotten)
        kinds = {m.instance: m.kind for m in coordinator.members}
        restored_keys = {
            key for name, r in replies.items() if kinds[name] == "environment" for key in r.restored
        }
        if finish:
            assert isinstance(second, InProcessCluster)  # checked above
            stage(f"{who} · finishing every restored rollout")
            finish_started = time.perf_counter()

            async def run_one(episode: EpisodeId) -> None:
                reply = await second.run(episode.rollout_id, episode.attempt + 1)
                results.append(reply)

            async with anyio.create_task_group() as group:
                for episode in continued:
                    group.start_soon(run_one, episode)
            finish_s = time.perf_counter() - finish_started
    stage(f"{who} · floor")
    floor_samples, files, size = sampled_floor(directory, root / "floor")
    floor_s = median(floor_samples)
    wanted = {episode.next_attempt().capture_key for episode in episodes}
    row: dict[str, Any] = {
        "rollouts": rollouts,
        "servers": servers,
        "parked": taken["parked"],
        "restored": len(restored_keys & wanted),
        "records_bytes": records_bytes(directory),
        "checkpoint_bytes": size,
        "files": files,
        "restore_s": restore_s,
        "server_restore_s": by_server,
        "floor_s": floor_s,
        "floor_samples_s": [round(sample, 6) for sample in floor_samples],
        "ratio": ratio(restore_s, floor_s),
        "us_per_rollout": us_per_rollout(restore_s, rollouts),
        "retired": len(others),
        "retire_s": round(retire_s, 4),
        "pause_s": taken["pause_s"],
        "park_s": round(park_s, 3),
    }
    if finish:
        calls = parked.activations * parked.turns
        good = sum(1 for reply in results if reply.get("result", {}).get("model_calls") == calls)
        row["finished"] = good
        row["lost"] = rollouts - good
        row["finish_s"] = round(finish_s, 3)
    return row


def run_restore_bench(
    directory: Path,
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 1,
    profiler: Callable[[], AbstractContextManager[Any]] | None = None,
    servers: str = "in-process",
) -> dict[str, Any]:
    """Restore time against records size and rollout count, each beside its floor.

    Args:
        directory: An empty scratch directory on the disk to measure.
        sizes: Rollouts in flight at the checkpoint, one row each.
        repeats: Crash-restore cycles per size (medians are reported).
        profiler: Entered around each timed restore (``--profile``).
        servers: Where the restore runs: ``in-process`` or ``processes`` (D447).
    """

    async def main() -> list[dict[str, Any]]:
        rows = []
        for rollouts in sizes:
            cycles = [
                await crash_restore_cycle(
                    directory / f"n{rollouts}-{index}",
                    rollouts,
                    finish=False,
                    profiler=profiler,
                    servers=servers,
                )
                for index in range(repeats)
            ]
            row = dict(cycles[-1])
            for name in ("restore_s", "floor_s", "retire_s"):
                row[name] = median([cycle[name] for cycle in cycles])
            row["server_restore_s"] = {
                name: median([cycle["server_restore_s"][name] for cycle in cycles])
                for name in cycles[-1]["server_restore_s"]
            }
            row["floor_samples_s"] = [s for cycle in cycles for s in cycle["floor_samples_s"]]
            row["ratio"] = ratio(row["restore_s"], row["floor_s"])
            row["restored"] = min(cycle["restored"] for cycle in cycles)
            rows.append(row)
        return rows

    rows = anyio.run(main)
    return {
        "suite": "restore",
        "parking": PARKING,
        "servers": servers,
        "floor": (
            "read every file of the checkpoint, write the same bytes, one fsync per file; "
            f"the median of {FLOOR_SAMPLES} samples, each copy removed before the next"
        ),
        "repeats": repeats,
        "rows": rows,
        "slopes": [*add_growth(rows, "restore_s"), *slopes(rows, "retire_s")],
    }
