"""The checkpoint benchmark: how long admission stays closed with N rollouts parked, against the
floor of writing the same bytes.

For each size a fresh :class:`~e2e._bench.common.InProcessCluster` gets N rollouts dispatched, and
the bench waits until every one has a model call generating (the worker is slow on purpose, so the
calls stay in flight). Then it takes ``repeats`` checkpoints the way ``coordinator.checkpoint``
does — prepare, commit, publish, resume — and after each one writes the same bytes (every file
of that checkpoint, ``LATEST`` included, and every record the worker staged for the generation
cuts) with one fsync per file: the floor. Ours and the floor
alternate, so both see the same disk.

- ``pause_s``: prepare sent → resume returned, the time admission stays closed;
- ``overhead_s``: ``pause_s`` minus the wait for boundaries (each prepare stage's longest
  readiness wait), what the control plane itself costs;
- ``floor_s`` and ``ratio`` = ``overhead_s / floor_s``;
- ``us_per_rollout`` (``overhead_s`` per rollout) and ``slope_us_per_added_rollout`` on each row,
  and ``slopes`` for ``overhead_s`` and ``pause_s`` between consecutive sizes (D348).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel

from coordinator import LATEST_FILE, checkpoint_directory, publish_checkpoint
from protocols import PREPARE_ORDER, EpisodeId

from .common import (
    PARKING,
    InProcessCluster,
    Workload,
    files_under,
    median,
    ratio,
    stage,
    wait_for,
    write_floor,
)
from .growth import add_growth
from .growth import slopes as slopes_of

SIZES: Final = (100, 1000, 4000)
SOAK_SIZE: Final = 16_000
PARKED_WORKLOAD: Final = Workload(activations=2, turns=1, max_tokens=128, token_delay_ms=20_000.0)
"""Slow generations (a token every 20 s): every rollout keeps a model call in flight while the
bench runs, so a checkpoint always finds N calls to cut and N episodes to park. In one process
each token wakes the whole in-process call chain (environment → agent → model → worker, about
0.8 ms on the development VM), so a faster pace would bill the parked calls' decoding to the
checkpoint it runs beside."""
DEADLINE_SECONDS: Final = 240.0
DISPATCH_BATCH: Final = 200
"""Rollouts dispatched before the dispatcher yields (keeps the event loop responsive)."""


def boundary_wait(waits: Mapping[str, float], kinds: Mapping[str, str]) -> float:
    """The wait for boundaries of one prepare: stages run one after another, members of a stage
    at once, so it is the sum over stages of the longest wait in each."""
    total = 0.0
    for kind in PREPARE_ORDER:
        stage = [seconds for name, seconds in waits.items() if kinds.get(name) == kind]
        total += max(stage, default=0.0)
    return total


async def take_checkpoint(
    cluster: InProcessCluster,
    checkpoint_id: str,
    episodes: Sequence[EpisodeId],
    deadline_seconds: float = DEADLINE_SECONDS,
) -> dict[str, Any]:
    """One checkpoint, stage by stage, as the drill's controller takes it; its timings.

    ``episodes`` are the attempts the controller has dispatched and not seen finish: the commit
    scope (a model commit needs one), less the restarts; the environment's export then says
    which of them were still running, and those are published as continued.

    Raises:
        RuntimeError: Some participant stayed blocked (everyone was resumed).
    """
    coordinator = cluster.coordinator
    assert coordinator is not None, "checkpointing is off in this cluster"
    kinds = {member.instance: member.kind for member in coordinator.members}
    directory = checkpoint_directory(cluster.root, checkpoint_id)
    deadline = time.time() + deadline_seconds
    cluster.waits.take()
    started = time.perf_counter()
    prepared = await coordinator.prepare(checkpoint_id, deadline)
    after_prepare = time.perf_counter()
    if not prepared.prepared:
        await coordinator.resume(checkpoint_id, time.time() + deadline_seconds)
        raise RuntimeError(f"prepare stayed blocked: {prepared.blockers()}")
    cut_counts = {
        name: sum(reply.report.counts.get(name, 0) for reply in prepared.replies.values())
        for name in ("cut", "cut_failed", "cut_skipped")
    }
    in_scope = prepared.continued(episodes)
    commits = await coordinator.commit(checkpoint_id, deadline, str(directory), in_scope)
    after_commit = time.perf_counter()
    exported = {
        key
        for name, reply in commits.items()
        if kinds[name] == "environment"
        for key in reply.episode_ids
    }
    scope = [episode for episode in in_scope if episode.capture_key in exported]
    await publish_checkpoint(cluster.root, checkpoint_id, coordinator.members, commits, scope)
    after_publish = time.perf_counter()
    await coordinator.resume(checkpoint_id, time.time() + deadline_seconds)
    ended = time.perf_counter()
    wait = boundary_wait(cluster.waits.take(), kinds)
    pause = ended - started
    return {
        "checkpoint_id": checkpoint_id,
        "directory": directory,
        "parked": len(scope),
        "pause_s": pause,
        "overhead_s": max(pause - wait, 0.0),
        "boundary_wait_s": wait,
        "prepare_s": after_prepare - started,
        "commit_s": after_commit - after_prepare,
        "publish_s": after_publish - after_commit,
        "resume_s": ended - after_publish,
        **cut_counts,
    }


def checkpoint_bytes(cluster: InProcessCluster, directory: Path) -> dict[str, bytes]:
    """Every file a checkpoint wrote (its directory, and ``LATEST``), by path (untimed)."""
    files = {str(path): path.read_bytes() for path in files_under(directory)}
    latest = directory.parent / LATEST_FILE
    files[str(latest)] = latest.read_bytes()
    return files


async def park(cluster: InProcessCluster, rollouts: int, group: Any, within_s: float) -> None:
    """Dispatch ``rollouts`` rollouts in ``group`` and wait until each one's model call is
    generating on the worker (an admitted call still resolving its ledger would otherwise do its
    dispatch work inside the measured checkpoint)."""
    for index in range(rollouts):
        group.start_soon(cluster.run, f"r{index:06d}")
        if index % DISPATCH_BATCH == DISPATCH_BATCH - 1:
            await anyio.lowlevel.checkpoint()
    await wait_for(
        lambda: cluster.generations_running() >= rollouts,
        f"{rollouts} generations running",
        within_s,
    )


async def measure_size(
    root: Path,
    rollouts: int,
    *,
    repeats: int,
    workload: Workload = PARKED_WORKLOAD,
    profiler: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """One row: ``repeats`` checkpoints of ``rollouts`` parked rollouts, each beside its floor."""
    cluster = InProcessCluster(root / "run", workload)
    started = time.perf_counter()
    samples: list[dict[str, Any]] = []
    floors: list[float] = []
    files = size = 0
    async with cluster.running(), anyio.create_task_group() as group:
        who = f"{rollouts:,} rollouts"
        stage(f"{who} · parking")
        await park(cluster, rollouts, group, within_s=max(120.0, rollouts * 0.05))
        setup_s = time.perf_counter() - started
        episodes = [EpisodeId(rollout_id=f"r{i:06d}", attempt=0) for i in range(rollouts)]
        staging = cluster.root / "staging"
        for repeat in range(repeats):
            of = f"{repeat + 1} of {repeats}"
            stage(f"{who} · checkpoint {of}: waiting for a new token on every call")
            # Untimed: each call generates past its last cut first, so every checkpoint of the
            # row cuts (and stages) every call, as checkpoints minutes apart would.
            await wait_for(
                cluster.every_generation_grew, "a new token on every call", within_s=120.0
            )
            stage(f"{who} · checkpoint {of}")
            staged_before = set(files_under(staging))
            with (profiler or nullcontext)():
                sample = await take_checkpoint(cluster, f"bench-{rollouts}-{repeat}", episodes)
            written = checkpoint_bytes(cluster, sample["directory"])
            # The generation cuts' durable prefixes are bytes this checkpoint wrote too.
            cut_files = [path for path in files_under(staging) if path not in staged_before]
            written.update({str(path): path.read_bytes() for path in cut_files})
            files, size = len(written), sum(len(data) for data in written.values())
            sample["cut_files"] = len(cut_files)
            stage(f"{who} · floor {of}")
            floors.append(write_floor(written, root / "floor" / str(repeat)))
            samples.append(sample)
        group.cancel_scope.cancel()  # the parked rollouts end with the bench
    overhead = median([s["overhead_s"] for s in samples])
    floor = median(floors)
    return {
        "rollouts": rollouts,
        "parked": min(s["parked"] for s in samples),
        "pause_s": median([s["pause_s"] for s in samples]),
        "overhead_s": overhead,
        "floor_s": floor,
        "ratio": ratio(overhead, floor),
        "boundary_wait_s": median([s["boundary_wait_s"] for s in samples]),
        "prepare_s": median([s["prepare_s"] for s in samples]),
        "commit_s": median([s["commit_s"] for s in samples]),
        "publish_s": median([s["publish_s"] for s in samples]),
        "resume_s": median([s["resume_s"] for s in samples]),
        "pause_samples_s": [round(s["pause_s"], 6) for s in samples],
        "cut": min(s["cut"] for s in samples),
        "cut_failed": max(s["cut_failed"] for s in samples),
        "files": files,
        "cut_files": [s["cut_files"] for s in samples],
        "bytes": size,
        "setup_s": round(setup_s, 3),
    }


def run_checkpoint_bench(
    directory: Path,
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 3,
    workload: Workload = PARKED_WORKLOAD,
    profiler: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """Every size, each in a fresh cluster under ``directory``; one JSON-ready object.

    Args:
        directory: An empty scratch directory on the disk to measure.
        sizes: Rollouts parked, one row each.
        repeats: Checkpoints per size (medians are reported).
        workload: The task and the worker's speed (slow, so calls stay in flight).
        profiler: Entered around each timed checkpoint (``--profile``).
    """

    async def main() -> list[dict[str, Any]]:
        rows = []
        for rollouts in sizes:
            rows.append(
                await measure_size(
                    directory / f"n{rollouts}",
                    rollouts,
                    repeats=repeats,
                    workload=workload,
                    profiler=profiler,
                )
            )
        return rows

    rows = anyio.run(main)
    # us_per_rollout is the overhead's; the pause's slope comes beside it (issue 20, item 4).
    growth = add_growth(rows, "overhead_s") + slopes_of(rows, "pause_s")
    return {
        "suite": "checkpoint",
        "parking": PARKING,
        "floor": "the same bytes (every file of the checkpoint, LATEST and the staged generation "
        "cut records), one fsync per file",
        "repeats": repeats,
        "rows": rows,
        "slopes": growth,
    }
