"""Start a real ``midflight serve`` process for a test and always kill its process group."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from e2e._launch.lifeline import Lifeline
from protocols import GenerationCutInventory, GenerationCutPrefix, GenerationCutReceipt

_LISTENING = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")


@contextmanager
def serve(
    role: str, *args: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``python -m e2e serve <role> --port 0 <args>``; yield its URL and the process."""
    command = [sys.executable, "-m", "e2e", "serve", role, "--port", "0", *args]
    lifeline = Lifeline()  # a test killed by its timeout takes its servers with it
    with open(log, "ab") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), **lifeline.env},
            start_new_session=True,
            pass_fds=lifeline.pass_fds,
        )
    lifeline.started()
    try:
        assert process.stdout is not None
        yield _read_url(process), process
    finally:
        kill_group(process)
        lifeline.cut()


def _read_url(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + 30
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    break
                seen += chunk
                match = _LISTENING.search(seen)
                if match:
                    return match.group(1).decode()
            elif process.poll() is not None:
                break
    raise AssertionError(f"the server never reported its port; stdout so far: {seen!r}")


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group, reap the process and close its pipes."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own meanwhile
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    if process.stdout is not None:
        process.stdout.close()


async def cut_one_call(
    client: httpx.AsyncClient, token: str, *, rollout_id: str, model_call_id: str
) -> GenerationCutReceipt:
    """Ask a real worker for a generation cut of one running call; its validated receipt."""
    prefix = GenerationCutPrefix(
        ticket_id="t1",
        rollout_id=rollout_id,
        attempt=0,
        model_call_id=model_call_id,
        admitted_at=2.5,
    )
    inventory = GenerationCutInventory.build(
        checkpoint_id="ckpt-1", server_name="policy", active_prefixes=[prefix]
    )
    reply = await client.post(
        "/ng-control/v1/generation-cut",
        content=inventory.model_dump_json(),
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    assert reply.status_code == 200, reply.text
    receipt = GenerationCutReceipt.model_validate_json(reply.content)
    receipt.validate_for(inventory)
    return receipt


def drill_json(keep_dir: Path, *args: str, timeout: float = 400) -> tuple[int, dict[str, Any]]:
    """Run ``python -m e2e drill --json --keep-dir KEEP_DIR <args>``; its exit code and figures."""
    completed = subprocess.run(
        [sys.executable, "-m", "e2e", "drill", "--json", "--keep-dir", str(keep_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.stdout.strip(), completed.stderr[-3000:]
    figures: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return completed.returncode, figures
