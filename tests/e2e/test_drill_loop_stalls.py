"""The drill reads its servers' event-loop stalls back from their logs (D406)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e._drill.baseline import baseline_shortfall
from e2e._drill.loop_stalls import LoopStalls, loop_stalls


def _stall(seconds: float, process: str, frame: str, gc_s: float = 0.25) -> str:
    stacks = [{"samples": 3, "frames": [frame, "asyncio.events:80 _run"]}]
    event = {"process": process, "stalled_s": seconds, "gc_s": gc_s, "gc_collections": 1}
    event |= {"samples": 3, "stacks": stacks}
    return json.dumps({**event, "event": "event_loop_stalled", "level": "warning"})


def test_the_longest_stall_is_named_with_its_log_process_and_frame(tmp_path: Path) -> None:
    (tmp_path / "agent-0.log").write_text(
        "not json at all, event_loop_stalled\n"
        + json.dumps({"event": "checkpoint.prepare", "detail": "event_loop_stalled"})
        + "\n"
        + _stall(2.0, "main", "e2e._servers.agent:10 seed")
        + "\n"
    )
    (tmp_path / "environment-1.log").write_text(
        _stall(5.5, "shard-0", "participants._fanout.channel:120 send", gc_s=1.5) + "\n"
    )
    (tmp_path / "notes.txt").write_text(_stall(60.0, "main", "ignored:1 not_a_log") + "\n")
    stalls = loop_stalls(tmp_path)
    assert stalls == LoopStalls(
        2, 5.5, "environment-1 shard-0: participants._fanout.channel:120 send", 7.5, 1.75
    )
    assert stalls.figures() == {
        "loop_stalls": 2,
        "loop_stall_longest_s": 5.5,
        "loop_stall_longest_where": "environment-1 shard-0: participants._fanout.channel:120 send",
        "loop_stall_s": 7.5,
        "loop_stall_gc_s": 1.75,
    }
    said = stalls.sentence(tmp_path)
    assert "stalled 2 times, the longest 5.5 s (environment-1 shard-0: " in said
    assert "7.5 s in all, 1.8 s of it in garbage collections" in said
    assert str(tmp_path) in said


def test_no_stall_adds_nothing(tmp_path: Path) -> None:
    assert loop_stalls(tmp_path / "absent") == LoopStalls()
    assert LoopStalls().sentence(tmp_path) == ""
    assert LoopStalls().figures()["loop_stalls"] == 0


def test_a_baseline_that_fell_short_names_its_servers_stalls(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "environment-0.log").write_text(
        _stall(45.6, "shard-1", "e2e._servers.environment:220 seed_agent") + "\n"
    )
    said = baseline_shortfall(tmp_path, 3991, 4000)
    assert said.startswith("the baseline finished 3,991 of 4,000 rollouts")
    assert "stalled once, the longest 45.6 s (environment-0 shard-1: " in said


WATCHED_SERVER = """
import time, anyio
from e2e._launch.serving import configure_server_logging
from e2e._launch.loop_watch import LoopWatch

def held_by_this_function():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        time.sleep(0.01)

async def main():
    async with LoopWatch(process="shard-3").watching():
        await anyio.sleep(0.3)
        held_by_this_function()
        await anyio.sleep(0.3)

configure_server_logging()
anyio.run(main)
"""


@pytest.mark.process
def test_a_real_servers_json_log_is_read_back(tmp_path: Path) -> None:
    """The server's own log format, written by a real process, is what the drill reads."""
    with (tmp_path / "environment-2.log").open("wb") as log:
        subprocess.run([sys.executable, "-c", WATCHED_SERVER], stderr=log, check=True, timeout=60)
    stalls = loop_stalls(tmp_path)
    assert stalls.count == 1 and 1.2 <= stalls.longest_s < 5, stalls
    assert stalls.where.startswith("environment-2 shard-3: __main__:"), stalls
    assert stalls.where.endswith(" held_by_this_function"), stalls
