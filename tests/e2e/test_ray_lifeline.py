"""A Ray head and every actor on it die with the process that started them (D242, D337).

A harness process starts a local Ray head and every reference server on it (resources with two
shard processes), then is SIGKILLed: no process of the head, no actor and no shard may outlive
it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from e2e._launch.ray_head import processes_of, wait_gone

from .processes import kill_group

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

HARNESS = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from e2e._launch.ray_head import RayHead
    from e2e._launch.ray_host import RayHost
    from e2e._launch.supervisor import Supervisor, SupervisorOptions

    head = RayHead()
    head.start()
    host = RayHost(head.address, head.env, "midflight-lifeline")
    host.connect()
    options = SupervisorOptions(role_options={"resources": {"workers": 2}})
    supervisor = Supervisor(Path(sys.argv[1]), "tok", options, host=host)
    supervisor.start_all()
    print(json.dumps({"id": head.head_id, "temp_dir": str(head.temp_dir),
                      "pids": head.processes()}), flush=True)
    time.sleep(600)
    """
)


def test_the_head_its_actors_and_their_shards_die_when_the_harness_is_sigkilled(
    tmp_path: Path,
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    pids: list[int] = []
    temp_dir: Path | None = None
    try:
        started = json.loads(process.stdout.readline())
        pids = started["pids"]
        temp_dir = Path(started["temp_dir"])
        # Ray's own processes and five server actors (worker, policy, resources, agent,
        # environment), with resources' two shard processes (`python -m e2e serve resources`).
        command_lines = [Path(f"/proc/{p}/cmdline").read_text() for p in pids]
        shards = [c for c in command_lines if "-m\0e2e\0serve\0resources\0" in c]
        assert len(shards) == 2, command_lines
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        assert wait_gone(pids, 60.0) == [], "processes outlived the harness"
        assert processes_of(started["id"], temp_dir) == []
    finally:
        kill_group(process)  # the harness too, when the test failed before killing it
        for pid in pids:  # never leave them behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
