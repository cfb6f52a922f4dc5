"""Where sequential ``record`` spends its time beyond the commit (issue 20, eighteenth sitting).

Run from the repository root: ``python scripts/record_handoff.py [ROWS] [--synchronous OFF]``,
optionally under ``taskset -c 0`` to keep every thread of the process on one core.

The SQLite ledger is written ``ROWS`` times (default 2,000; four rows per rollout, the rows of
``bench ledger``) in three ways, each into its own fresh ledger, one after another:

- ``sync_append``: the commit thread's work (``_commit_group`` of one row) on the calling thread;
- ``record``: ``await ledger.record(...)`` from an event loop, through the group committer's
  thread, as a server records a call;
- ``bare_hop``: an empty job through the bench's ``_ThreadHop``, the round trip that
  ``bench ledger``'s ``floor_via_thread`` adds to its floor.

With ``--synchronous OFF`` no commit waits for the disk, so the figures are CPU and hand-offs
alone. ``docs/performance.md`` reports what they showed on the development VM, unpinned, on one
core, and beside a busy machine.
"""

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

USAGE = "usage: python scripts/record_handoff.py [ROWS] [--synchronous FULL|OFF]"


async def measure(rows: int, synchronous: str) -> dict[str, float]:
    """µs per row of each way, and of building and encoding a row on the loop."""
    from e2e._bench.ledger import _commit
    from e2e._bench.ledger_floors import _ThreadHop
    from participants._ledger.sqlite import SqliteCaptureLedger
    from protocols import custody_row, encode_row

    keys = [f"rollout-{i // 4}" for i in range(rows)]
    commits = [_commit(key, i % 4) for i, key in enumerate(keys)]
    built = [custody_row(c) for c in commits]
    scratch = Path(tempfile.mkdtemp(prefix="record-handoff-"))
    figures: dict[str, float] = {}
    try:
        start = time.perf_counter()
        for commit in commits:
            encode_row(custody_row(commit))
        figures["build_and_encode"] = time.perf_counter() - start

        ledger = SqliteCaptureLedger(scratch / "sync", synchronous=synchronous)  # type: ignore[arg-type]
        start = time.perf_counter()
        for key, row in zip(keys, built, strict=True):
            ledger._append(key, row, failure=False, staging_key="")
        figures["sync_append"] = time.perf_counter() - start
        ledger.close()

        ledger = SqliteCaptureLedger(scratch / "record", synchronous=synchronous)  # type: ignore[arg-type]
        start = time.perf_counter()
        for commit in commits:
            await ledger.record(commit)
        figures["record"] = time.perf_counter() - start
        ledger.close()

        with _ThreadHop() as hop:
            start = time.perf_counter()
            for _ in commits:
                await hop.run(lambda: None)
            figures["bare_hop"] = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch)
    return {name: round(seconds / rows * 1e6, 1) for name, seconds in figures.items()}


def main(argv: list[str]) -> int:
    rows, synchronous = 2000, "FULL"
    args = list(argv)
    try:
        if "--synchronous" in args:
            at = args.index("--synchronous")
            synchronous = args[at + 1]
            del args[at : at + 2]
            if synchronous not in ("FULL", "OFF"):
                raise ValueError(synchronous)
        if args:
            (only,) = args
            rows = int(only)
            if rows < 1:
                raise ValueError(only)
    except (ValueError, IndexError):
        print(USAGE, file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    figures = asyncio.run(measure(rows, synchronous))
    handoff = figures["record"] - figures["sync_append"] - figures["build_and_encode"]
    print(f"synchronous={synchronous}, {rows} rows, µs per row:")
    for name, value in figures.items():
        print(f"  {name:17s} {value:8.1f}")
    print(f"  {'hand-off':17s} {handoff:8.1f}  (record - sync_append - build_and_encode)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
