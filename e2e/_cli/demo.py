"""``midflight demo``: a short scripted tour of what is built so far.

Part one writes one participant's share of a checkpoint, reads it back verified, shows that a
repeat is idempotent and a conflicting commit is refused, then flips one byte and shows the read
refuse it. Part two runs the example participant as a real process through a checkpoint, a
SIGKILL and a restore. It is the README's main command until the crash-restore drill exists.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.table import Table

from participants import RecordsWriter, read_participant_checkpoint
from protocols import (
    CONTROL_PREFIX,
    ERROR_TABLE,
    PHASE_TRANSITIONS,
    PREPARE_ORDER,
    EpisodeId,
    WireError,
    participant_directory,
    task_digest,
)

from .._launch.spawn import ServerProcess
from .output import JsonOption, console, emit, usage_error

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "minimal_participant.py"


def _serve(root: Path, token: str, name: str) -> ServerProcess:
    if not EXAMPLE.is_file():
        raise FileNotFoundError(f"the example participant is missing: {EXAMPLE}")
    return ServerProcess(
        [sys.executable, str(EXAMPLE), "--port", "0", "--tick-ms", "20"],
        env={"MIDFLIGHT_CONTROL_TOKEN": token},
        log_path=root / f"{name}.log",
    )


def _control(client: httpx.Client, token: str, route: str, **body: Any) -> dict[str, Any]:
    body.setdefault("deadline_ts", time.time() + 30)
    reply = client.post(
        f"{CONTROL_PREFIX}/{route}", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    result: dict[str, Any] = reply.json()
    result["http_status"] = reply.status_code
    return result


def run_participant_demo(root: Path, *, episodes: int = 3) -> dict[str, Any]:
    """Checkpoint, crash and restore the example participant; return what was observed."""
    token = secrets.token_urlsafe(16)
    checkpoint = root / "ckpt-1"
    keys = [f"episode-{i}" for i in range(episodes)]
    scope = [{"rollout_id": key} for key in keys]
    with _serve(root, token, "first") as server, httpx.Client(base_url=server.url, timeout=30) as c:
        unauthenticated = c.get(f"{CONTROL_PREFIX}/status").status_code
        for key in keys:
            c.post(f"/ng-rollout/{key}/start", json={"target": 100_000}).raise_for_status()
        deadline = time.monotonic() + 20
        while c.get(f"/ng-rollout/{keys[-1]}").json()["step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        prepared = _control(c, token, "prepare", checkpoint_id="ckpt-1")
        committed = _control(
            c,
            token,
            "commit",
            checkpoint_id="ckpt-1",
            checkpoint_dir=str(checkpoint),
            episode_ids=scope,
        )
        saved = {key: c.get(f"/ng-rollout/{key}").json()["step"] for key in keys}
        resumed = _control(c, token, "resume", checkpoint_id="ckpt-1")
        stale = _control(c, token, "prepare", checkpoint_id="ckpt-1")
        server.kill()
    with (
        _serve(root, token, "second") as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        restored = _control(
            c,
            token,
            "restore",
            checkpoint_id="restore-1",
            checkpoint_dir=str(checkpoint),
            episode_ids=scope,
        )
        _control(c, token, "resume", checkpoint_id="restore-1")
        crashed_attempt = c.post(f"/ng-rollout/{keys[0]}/start", json={"target": 1})
        continued = {
            key: c.post(f"/ng-rollout/{key}-a1/start", json={"target": 1}).json()["step"]
            for key in keys
        }
    return {
        "unauthenticated_status": unauthenticated,
        "prepare_phase": prepared.get("phase"),
        "committed_episodes": committed.get("episode_ids"),
        "manifest_records": committed.get("manifest", {}).get("record_count"),
        "saved_steps": saved,
        "resume_phase": resumed.get("phase"),
        "prepare_after_resume": stale.get("error", {}).get("code"),
        "restored": restored.get("restored"),
        "crashed_attempt": crashed_attempt.json().get("error", {}).get("code"),
        "continued_steps": continued,
    }


def _episode_records(count: int) -> list[dict[str, Any]]:
    records = []
    for index in range(count):
        episode = EpisodeId(rollout_id=f"demo-{index:03d}", attempt=index % 2)
        task = {"taskset": "counter", "task_id": episode.rollout_id}
        records.append(
            {
                "episode_id": episode.model_dump(),
                "task_digest": task_digest(task),
                "boundary": {"next": "invoke_agent", "activation": 1 + index % 2},
            }
        )
    return records


def run_demo(root: Path, *, records: int = 5) -> dict[str, Any]:
    """Run the tour in ``root`` and return what it observed."""
    directory = Path(participant_directory(root / "ckpt-1", "environment", "environment"))
    episodes = _episode_records(records)

    def writer(checkpoint_id: str) -> RecordsWriter:
        return RecordsWriter(
            directory, kind="environment", instance="environment", checkpoint_id=checkpoint_id
        )

    manifest = writer("ckpt-1").write(episodes)
    share = read_participant_checkpoint(directory, kind="environment", instance="environment")
    repeat = writer("ckpt-1").write(episodes)
    try:
        writer("ckpt-1").write(episodes[:1])
        conflict = "accepted (wrong!)"
    except WireError as exc:
        conflict = exc.code
    stopped = writer("ckpt-1")
    stopped.stop()
    try:
        stopped.write(episodes)
        stop_result = "published (wrong!)"
    except WireError as exc:
        stop_result = exc.code

    records_path = directory / manifest["records_file"]
    data = bytearray(records_path.read_bytes())
    data[len(data) // 2] ^= 0x01
    records_path.write_bytes(bytes(data))
    try:
        read_participant_checkpoint(directory, kind="environment", instance="environment")
        corrupt = "accepted (wrong!)"
    except WireError as exc:
        corrupt = f"{exc.code}: {exc.detail}"
    return {
        "manifest": manifest,
        "records_read": len(share.records),
        "round_trip_equal": share.records == episodes,
        "repeat_identical": repeat == manifest,
        "conflicting_commit": conflict,
        "stopped_write": stop_result,
        "corrupt_read": corrupt,
        "prepare_order": list(PREPARE_ORDER),
        "phase_transitions": len(PHASE_TRANSITIONS),
        "error_codes": len(ERROR_TABLE),
    }


def register(app: typer.Typer) -> None:
    """Add ``demo`` to the app."""

    @app.command("demo")
    def demo_command(
        directory: Annotated[
            Path | None,
            typer.Option("--dir", help="Write here instead of a temporary directory."),
        ] = None,
        records: Annotated[int, typer.Option(min=1, help="Episode records to write.")] = 5,
        as_json: JsonOption = False,
    ) -> None:
        """Write, verify and corrupt one participant's share of a checkpoint."""
        with tempfile.TemporaryDirectory(prefix="midflight-demo-") as scratch:
            root = directory or Path(scratch)
            try:
                result = run_demo(root / "storage", records=records)
                result["participant"] = run_participant_demo(root / "participant")
            except (OSError, WireError) as exc:  # --dir names a file, or one we may not write
                usage_error(f"--dir {root}: {exc}")
        live = result["participant"]

        def render() -> None:
            table = Table(title="midflight demo: one participant's share of a checkpoint")
            table.add_column("step")
            table.add_column("outcome")
            m = result["manifest"]
            table.add_row(
                "write records + manifest", f"{m['record_count']} records, {m['records_file']}"
            )
            table.add_row(
                "read back, digest and count verified",
                f"{result['records_read']} records, equal: {result['round_trip_equal']}",
            )
            table.add_row("repeat the same commit", f"same manifest: {result['repeat_identical']}")
            table.add_row(
                "a different commit into the same directory", result["conflicting_commit"]
            )
            table.add_row("a write stopped before publication", result["stopped_write"])
            table.add_row("flip one byte of the records, read again", result["corrupt_read"])
            table.add_row("prepare order", " → ".join(result["prepare_order"]))
            table.add_row(
                "phase table / error table",
                f"{result['phase_transitions']} transitions, {result['error_codes']} codes",
            )
            console.print(table)
            crash = Table(title="midflight demo: the example participant through a crash")
            crash.add_column("step")
            crash.add_column("outcome")
            crash.add_row("control route without the token", str(live["unauthenticated_status"]))
            crash.add_row("prepare while episodes run", str(live["prepare_phase"]))
            crash.add_row(
                "commit", f"{live['manifest_records']} episodes: {live['committed_episodes']}"
            )
            crash.add_row("saved steps", str(live["saved_steps"]))
            crash.add_row(
                "resume, then prepare the same id",
                f"{live['resume_phase']}, then {live['prepare_after_resume']}",
            )
            crash.add_row("SIGKILL, restore into a fresh process", str(live["restored"]))
            crash.add_row("the crashed attempt asks to run", str(live["crashed_attempt"]))
            crash.add_row("the next attempts continue at step", str(live["continued_steps"]))
            console.print(crash)

        emit(result, as_json=as_json, render=render)
        ok = (
            result["round_trip_equal"]
            and result["repeat_identical"]
            and result["conflicting_commit"] == "invalid_checkpoint_state"
            and result["stopped_write"] == "invalid_checkpoint_state"
            and result["corrupt_read"].startswith("invalid_checkpoint_state")
            and live["unauthenticated_status"] == 401
            and live["prepare_phase"] == "prepared"
            and live["prepare_after_resume"] == "stale_checkpoint"
            and live["crashed_attempt"] == "stale_attempt"
            and live["continued_steps"] == live["saved_steps"]
        )
        raise typer.Exit(0 if ok else 1)
