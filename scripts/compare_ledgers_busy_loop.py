"""Both ledger layouts recording while the event loop is busy, against an idle loop (D345).

Run from the repository root: ``python scripts/compare_ledgers_busy_loop.py [ROLLOUTS]``. Waves
of 64 rollouts record 4 calls each. In the busy runs a coroutine on the same loop burns the CPU
in slices of 2 ms with a yield between them, as a policy server's loop serving thousands of
streams does. Prints µs per record for each layout, idle and busy.
"""

import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import anyio
import anyio.lowlevel

from e2e._bench.ledger import _commit
from participants import FileCaptureLedger, SqliteCaptureLedger

IN_FLIGHT = 64
SLICE_S = 0.002


async def measure(layout: str, *, busy: bool, rollouts: int) -> float:
    with tempfile.TemporaryDirectory() as scratch:
        opened = SqliteCaptureLedger if layout == "sqlite" else FileCaptureLedger
        ledger = opened(Path(scratch) / "ledger")
        keys = [f"r-{index}" for index in range(rollouts)]
        commits = {key: [_commit(key, turn) for turn in range(4)] for key in keys}
        finished = False

        async def burn() -> None:
            while not finished:
                end = time.perf_counter() + SLICE_S
                while time.perf_counter() < end:
                    pass
                await anyio.lowlevel.checkpoint()

        async def one(key: str) -> None:
            for work in commits[key]:
                await ledger.record(work)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            if busy:
                group.start_soon(burn)
            for first in range(0, rollouts, IN_FLIGHT):
                async with anyio.create_task_group() as wave:
                    for key in keys[first : first + IN_FLIGHT]:
                        wave.start_soon(one, key)
            finished = True
        elapsed = time.perf_counter() - start
        ledger.close()
        return elapsed / (rollouts * 4) * 1e6


def main() -> None:
    rollouts = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    for busy in (False, True):
        for layout in ("sqlite", "file"):
            us = anyio.run(partial(measure, layout, busy=busy, rollouts=rollouts))
            print(f"{layout:6s} {'busy' if busy else 'idle'} loop: {us:9.0f} µs per record")


if __name__ == "__main__":
    main()
