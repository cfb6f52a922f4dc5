"""A child process for the crash tests: writes a checkpoint share and can freeze at a step.

Usage: ``python -m tests.participants.crash_writer DIR STEP RECORDS`` — freezes (announcing
``at STEP`` on stdout) when the write reaches STEP; with STEP ``none`` it writes share after share
into ``DIR/<n>`` until killed, announcing each start.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from participants import RecordsWriter


def _records(count: int) -> list[dict[str, object]]:
    return [
        {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "pad": "x" * 200}
        for i in range(count)
    ]


def main() -> None:
    directory, step, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

    def on_step(name: str) -> None:
        if name == step:
            print(f"at {name}", flush=True)
            time.sleep(3600)

    if step != "none":
        RecordsWriter(
            directory, kind="model", instance="policy", checkpoint_id="c", on_step=on_step
        ).write(_records(count))
        print("done", flush=True)
        return
    n = 0
    while True:
        print(f"start {n}", flush=True)
        RecordsWriter(directory / str(n), kind="model", instance="policy", checkpoint_id="c").write(
            _records(count)
        )
        n += 1


if __name__ == "__main__":
    main()
