"""Where a checkpoint's extra cost per rollout goes at larger sizes (issue 20, fifteenth sitting).

Run from the repository root:

- ``python scripts/checkpoint_growth.py 8000 32000`` runs ``bench checkpoint`` once per size, each
  in a fresh process, and reports what the process spent inside the timed checkpoint: the pause
  and its parts, user and system CPU, minor page faults, and every garbage collection
  (``gc.callbacks``), each also per rollout, with the load average (1 minute) before and after.
- ``--ballast N`` first builds N unrelated live objects in each process (small dictionaries
  holding a string and a list): the same checkpoint beside a bigger heap.
- ``--fault-probe GIB`` maps GIB of fresh anonymous memory four times (after pauses of 0, 0, 10
  and 0 s) and writes one byte per 4 KiB page: µs per page fault on this machine.

``docs/performance.md`` reports both on the development VM: system time per rollout grew 2.5 times
from 8,000 to 32,000 while faults per rollout stayed flat, and a fresh page fault there costs
3 to 12 µs.
"""

import contextlib
import gc
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KEPT = ("rollouts", "pause_s", "prepare_s", "commit_s", "publish_s", "resume_s", "cut_failed")
USAGE = "usage: python scripts/checkpoint_growth.py ROLLOUTS... [--ballast N] | --fault-probe GIB"


def measure(rollouts: int, ballast: int) -> dict[str, Any]:
    """One checkpoint of ``rollouts`` beside ``ballast`` live objects, in this process."""
    from e2e._bench.checkpoint import run_checkpoint_bench
    from e2e._bench.common import quiet_logs

    kept = [{"n": i, "text": str(i), "list": [i]} for i in range(ballast)]
    window: dict[str, Any] = {"collections": [0, 0, 0], "collection_s": 0.0}
    started = [0.0]

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            window["collections"][info["generation"]] += 1
            window["collection_s"] += time.perf_counter() - started[0]

    @contextlib.contextmanager
    def watched() -> Iterator[None]:
        window["tracked_objects"] = len(gc.get_objects())  # before the checkpoint's timer
        gc.callbacks.append(on_collection)
        before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            yield
        finally:
            after = resource.getrusage(resource.RUSAGE_SELF)
            gc.callbacks.remove(on_collection)
            window["minor_faults"] = after.ru_minflt - before.ru_minflt
            window["user_s"] = after.ru_utime - before.ru_utime
            window["system_s"] = after.ru_stime - before.ru_stime

    load = os.getloadavg()[0]
    with quiet_logs():
        result = run_checkpoint_bench(
            Path(tempfile.mkdtemp()), sizes=[rollouts], repeats=1, profiler=watched
        )
    row = result["rows"][0]
    del kept
    per = 1e6 / rollouts
    return {
        "ballast": ballast,
        **{key: row[key] for key in KEPT},
        "us_per_rollout": round(row["pause_s"] * per, 1),
        "user_s": round(window["user_s"], 3),
        "system_s": round(window["system_s"], 3),
        "user_us_per_rollout": round(window["user_s"] * per, 1),
        "system_us_per_rollout": round(window["system_s"] * per, 1),
        "minor_faults": window["minor_faults"],
        "faults_per_rollout": round(window["minor_faults"] / rollouts, 2),
        "tracked_objects": window["tracked_objects"],
        "collections_in_window": window["collections"],
        "collection_s": round(window["collection_s"], 3),
        "load": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def fault_probe(gib: float) -> None:
    """µs per first write to a fresh anonymous page, four times."""
    size = int(gib * 2**30)
    for pause in (0, 0, 10, 0):
        time.sleep(pause)
        mapped = mmap.mmap(-1, size)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        begun = time.perf_counter()
        for offset in range(0, size, mmap.PAGESIZE):
            mapped[offset] = 1
        took = time.perf_counter() - begun
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        mapped.close()
        figures = {"after_pause_s": pause, "gib": gib, "seconds": round(took, 3), "faults": faults}
        print(json.dumps(figures | {"us_per_fault": round(took / max(faults, 1) * 1e6, 2)}))


def main() -> None:
    args = sys.argv[1:]
    try:
        if args[:1] == ["--one"]:
            print(json.dumps(measure(int(args[1]), int(args[2]))))
            return
        if args[:1] == ["--fault-probe"] and len(args) == 2:
            fault_probe(float(args[1]))
            return
        ballast = 0
        if "--ballast" in args:
            at = args.index("--ballast")
            ballast = int(args[at + 1])
            del args[at : at + 2]
        sizes = [int(size) for size in args]
        if not sizes:
            raise ValueError
    except (IndexError, ValueError):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    for size in sizes:
        # A fresh process per size: the heap of one run must not carry into the next.
        subprocess.run([sys.executable, __file__, "--one", str(size), str(ballast)], check=True)


if __name__ == "__main__":
    main()
