"""The cluster a restore bench restores from: parked and checkpointed in a process of its own, then
SIGKILLed (D376).

A participant refuses to restore into a process that served live work (D19), so a real restore
always starts in a fresh process. The restore bench once parked, checkpointed and restored in
one process, and even with the dead cluster collected (D267) its heap made every step of the
restore slower: 16,000 rollouts restored in 1.8 s there against 1.2 s in a fresh process, the
same calls, each about half again as long. So the first cluster lives in a child process. It
says each stage and then its figures as JSON lines on stdout, and is SIGKILLed once its
checkpoint is published: a real crash, after which the bench's own process restores as a fresh
one would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Final

import anyio

from protocols import EpisodeId

from .._launch.lifeline import Lifeline, hold_lifeline
from .checkpoint import park, take_checkpoint
from .common import InProcessCluster, Workload, quiet_logs, stage

_CHILD: Final = "from e2e._bench.crashed_cluster import child_main; child_main()"
STAGE: Final = "stage"
PARKED: Final = "parked"


def _say(out: IO[str], kind: str, value: Any) -> None:
    out.write(json.dumps({kind: value}, default=str) + "\n")  # a Path as its text
    out.flush()


async def _park_and_checkpoint(
    out: IO[str], run_root: Path, rollouts: int, parked: Workload
) -> tuple[float, dict[str, Any]]:
    """Park ``rollouts`` rollouts on a cluster and checkpoint them; the cluster stays up."""
    episodes = [EpisodeId(rollout_id=f"r{i:06d}", attempt=0) for i in range(rollouts)]
    started = time.perf_counter()
    cluster = InProcessCluster(run_root, parked)
    async with cluster.running(), anyio.create_task_group() as group:
        who = f"{rollouts:,} rollouts"
        _say(out, STAGE, f"{who} · parking")
        await park(cluster, rollouts, group, within_s=max(120.0, rollouts * 0.05))
        park_s = time.perf_counter() - started
        _say(out, STAGE, f"{who} · checkpoint before the crash")
        taken = await take_checkpoint(cluster, "before-crash", episodes)
        # Every rollout's task ends here, as in a crash; the process itself is killed next.
        group.cancel_scope.cancel()
    return park_s, taken


def child_main() -> None:
    """The child: ``<run root> <rollouts> <workload JSON>``; the figures, then wait to be killed.

    Its stdout carries only the JSON lines the parent reads. Its servers log as the bench's own
    do (:func:`quiet_logs`): warnings and errors, on stderr, so a bench's progress display and
    ``--json`` stay clean.
    """
    hold_lifeline()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    run_root, rollouts, workload = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    with quiet_logs():  # as in the bench's own process: warnings and errors only, on stderr
        park_s, taken = anyio.run(
            _park_and_checkpoint, out, run_root, rollouts, Workload(**workload)
        )
    _say(out, PARKED, {"park_s": park_s, "taken": taken})
    signal.pause()  # the parent SIGKILLs this process: the crash


@dataclass(frozen=True)
class CrashedCluster:
    """What the parked cluster reported before it was killed, and how it died."""

    park_s: float
    taken: dict[str, Any]
    """``take_checkpoint``'s figures (its ``directory`` as text)."""
    pid: int
    returncode: int
    """``-SIGKILL``: it was killed, not stopped."""


async def park_and_crash(run_root: Path, rollouts: int, parked: Workload) -> CrashedCluster:
    """Park and checkpoint ``rollouts`` rollouts in a child process, then SIGKILL it.

    Raises:
        RuntimeError: The child ended without its figures (its stderr is the bench's).
    """
    lifeline = Lifeline()  # the child dies with this process, however this one dies
    process = await anyio.open_process(
        [sys.executable, "-c", _CHILD, str(run_root), str(rollouts), json.dumps(asdict(parked))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # its logs go where the bench's go
        env={**os.environ, **lifeline.env},
        pass_fds=lifeline.pass_fds,
        start_new_session=True,
    )
    lifeline.started()
    figures: dict[str, Any] | None = None
    try:
        assert process.stdout is not None
        buffer = b""
        async for chunk in process.stdout:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                said = json.loads(line)
                if STAGE in said:
                    stage(said[STAGE])
                elif PARKED in said:
                    figures = said[PARKED]
            if figures is not None:
                break
    finally:
        process.kill()  # SIGKILL, whatever state it is in
        lifeline.cut()
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()
    code = process.returncode
    if figures is None or code is None:
        raise RuntimeError(f"the parked cluster's process ended (code {code}) without its figures")
    return CrashedCluster(float(figures["park_s"]), dict(figures["taken"]), process.pid, code)
