"""The steady-state overhead benchmark: rollout throughput with checkpointing off, on but idle,
and on with a checkpoint every K seconds.

Each mode runs for a fixed window on a fresh in-process cluster with ``concurrency`` rollouts in
flight (closed loop: a finished rollout is replaced at once) and counts the rollouts finished in
the window. The modes alternate round by round, so all three see the same machine.

- **disabled**: the same servers built without a control token — no control route and no
  generation-cut route exist, nobody can close admission, and no controller talks to them. The
  capture ledger still records every call: it is the training-token capture the trainer reads
  whether or not checkpoints are taken.
- **idle**: control routes on, and the controller polls every participant's ``status`` once a
  second (what a controller watching its servers does), never checkpointing.
- **periodic**: as idle, plus a published checkpoint of every rollout in flight every
  ``period_s`` seconds (a rollout that meets closed admission waits and retries).

The floor of this suite is the disabled mode itself: overhead is the throughput lost against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Final

import anyio

from protocols import EpisodeId

from .checkpoint import take_checkpoint
from .common import PARKING, InProcessCluster, Workload, stage

MODES: Final = ("disabled", "idle", "periodic")
THROUGHPUT_WORKLOAD: Final = Workload(activations=2, turns=1, max_tokens=16, token_delay_ms=1.0)
STATUS_POLL_SECONDS: Final = 1.0


async def _throughput_round(
    root: Path,
    mode: str,
    *,
    seconds: float,
    concurrency: int,
    period_s: float,
    workload: Workload,
    profiler: Callable[[], AbstractContextManager[Any]] | None,
) -> dict[str, Any]:
    """One window of one mode: rollouts finished, and checkpoints taken."""
    cluster = InProcessCluster(root, workload, control=mode != "disabled")
    in_flight: dict[str, int] = {}
    finished = 0
    checkpoints = 0
    counter = iter(range(1 << 62))

    async def loop(deadline: float) -> None:
        nonlocal finished
        while time.perf_counter() < deadline:
            rollout = f"r{next(counter):08d}"
            in_flight[rollout] = 0
            reply = await cluster.run(rollout)
            del in_flight[rollout]
            if "result" not in reply:
                raise RuntimeError(f"rollout {rollout} failed: {reply}")
            if time.perf_counter() < deadline:
                finished += 1

    async def watch(deadline: float) -> None:
        assert cluster.coordinator is not None
        while time.perf_counter() < deadline:
            await anyio.sleep(STATUS_POLL_SECONDS)
            for member in cluster.coordinator.members:
                await member.client.status()

    async def checkpoint_every(deadline: float) -> None:
        nonlocal checkpoints
        while (time.perf_counter() + period_s) < deadline:
            await anyio.sleep(period_s)
            scope = [EpisodeId(rollout_id=r, attempt=a) for r, a in sorted(in_flight.items())]
            await take_checkpoint(cluster, f"periodic-{checkpoints}", scope)
            checkpoints += 1

    async with cluster.running():
        with (profiler or nullcontext)():
            started = time.perf_counter()
            deadline = started + seconds
            async with anyio.create_task_group() as group:
                for _ in range(concurrency):
                    group.start_soon(loop, deadline)
                if mode != "disabled":
                    group.start_soon(watch, deadline)
                if mode == "periodic":
                    group.start_soon(checkpoint_every, deadline)
            elapsed = time.perf_counter() - started
    # Rollouts still running at the deadline finish (uncounted) before the cluster stops.
    return {"mode": mode, "finished": finished, "seconds": elapsed, "checkpoints": checkpoints}


def run_overhead_bench(
    directory: Path,
    *,
    seconds: float = 10.0,
    rounds: int = 3,
    concurrency: int = 32,
    period_s: float = 5.0,
    workload: Workload = THROUGHPUT_WORKLOAD,
    profiler: Callable[[], AbstractContextManager[Any]] | None = None,
) -> dict[str, Any]:
    """Throughput of each mode over ``rounds`` alternating windows; one JSON-ready object.

    Args:
        directory: An empty scratch directory on the disk to measure.
        seconds: The length of each window.
        rounds: Windows per mode (the modes alternate).
        concurrency: Rollouts in flight.
        period_s: Seconds between checkpoints in the periodic mode.
        workload: The task and the worker's speed.
        profiler: Entered around every idle window (``--profile``: the hot path of a rollout).
    """
    if period_s >= seconds:
        raise ValueError("period_s must be shorter than a window, or no checkpoint is taken")

    async def main() -> list[dict[str, Any]]:
        results = []
        for index in range(rounds):
            for mode in MODES:
                stage(f"window {index + 1} of {rounds} · {mode} · {seconds:g} s")
                results.append(
                    await _throughput_round(
                        directory / f"round{index}-{mode}",
                        mode,
                        seconds=seconds,
                        concurrency=concurrency,
                        period_s=period_s,
                        workload=workload,
                        profiler=profiler if mode == "idle" else None,
                    )
                )
        return results

    windows = anyio.run(main)
    per_s: dict[str, float] = {}
    for mode in MODES:
        done = sum(w["finished"] for w in windows if w["mode"] == mode)
        spent = seconds * sum(1 for w in windows if w["mode"] == mode)
        per_s[mode] = round(done / spent, 3) if spent > 0 else 0.0
    disabled = per_s["disabled"]

    def lost_pct(mode: str) -> float | None:
        return round((disabled - per_s[mode]) / disabled * 100, 2) if disabled > 0 else None

    return {
        "suite": "overhead",
        "parking": PARKING,
        "floor": "disabled: the same servers without a control token (no control routes, "
        "admission never gated, no controller calls)",
        "concurrency": concurrency,
        "window_s": seconds,
        "rounds": rounds,
        "period_s": period_s,
        "disabled_per_s": disabled,
        "idle_per_s": per_s["idle"],
        "periodic_per_s": per_s["periodic"],
        "idle_overhead_pct": lost_pct("idle"),
        "periodic_overhead_pct": lost_pct("periodic"),
        "checkpoints": sum(w["checkpoints"] for w in windows),
        "windows": [{**w, "seconds": round(w["seconds"], 3)} for w in windows],
    }
