"""``midflight bench tracing`` with tiny sizes: the figures it reports are the ones it measured.

The suite runs in a child process. OpenTelemetry keeps one tracer provider per process and each
module-level ``ProxyTracer`` binds to the first provider it meets: a bench run inside the test
process would bind the servers' tracers to the bench's provider, and the tests that record spans
through ``tests/span_capture.py`` (in this process or a later test on the same xdist worker)
would then see none of theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from e2e import build_app
from protocols import COLLECTION_CHECKPOINT_SPAN, ROLLOUT_SPAN

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"rollouts": 6, "concurrency": 2, "rounds": 1, "parked": 3}
CHILD = """
import json, sys
from pathlib import Path
from e2e._bench.common import quiet_logs
from e2e._bench.tracing import run_tracing_bench
from participants import tracing_on
with quiet_logs():
    payload = run_tracing_bench(Path(sys.argv[1]), micro_loops=2000, **json.loads(sys.argv[2]))
print(json.dumps({"payload": payload, "tracing_on_after": tracing_on()}))
"""


def child_env() -> dict[str, str]:
    """This environment without anything that would turn tracing on in the child."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MIDFLIGHT_TRACE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_child(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def spans_in(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_on_writes_spans_off_writes_none_and_tracing_is_off_afterwards(tmp_path: Path) -> None:
    done = run_child(["-c", CHILD, str(tmp_path), json.dumps(SMALL)])
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["tracing_on_after"] is False, "the bench left its tracer provider installed"
    payload = reply["payload"]
    assert payload["suite"] == "tracing"
    assert payload["floor"].startswith("off: no tracer provider installed")
    assert "ASGITransport" in payload["parking"]
    assert len(payload["loadavg"]) == 3
    windows = payload["windows"]
    assert [(w["round"], w["mode"]) for w in windows] == [
        (0, "off"),
        (0, "checkpoints"),
        (0, "on"),
    ]
    off, only, on = windows
    # Off wrote nothing to the spans file; on wrote spans for the rollouts and the checkpoint;
    # with the rollouts untraced, only the checkpoint wrote spans, as many as when all is traced.
    assert off["spans"] == 0 and off["checkpoint_spans"] == 0 and payload["off_spans"] == 0
    assert on["spans"] > 0 and on["checkpoint_spans"] > 0
    assert only["spans"] == 0 and payload["checkpoints_spans_per_rollout"] == 0
    assert only["checkpoint_trace_spans"] == only["checkpoint_spans"] > 0
    assert payload["checkpoints_ratio"] == pytest.approx(
        payload["checkpoints_us_per_call"] / payload["off_us_per_call"], abs=1e-3
    )
    assert on["checkpoint_trace_spans"] == on["checkpoint_spans"], "one trace per checkpoint"
    lines = spans_in(tmp_path / payload["spans_file"])
    assert len(lines) >= on["spans"] + on["checkpoint_spans"] + only["checkpoint_spans"]
    assert sum(line["name"] == ROLLOUT_SPAN for line in lines) >= SMALL["rollouts"]
    assert sum(line["name"] == COLLECTION_CHECKPOINT_SPAN for line in lines) == 2
    # Every request of a traced rollout got a server span (the rollout span is one more).
    assert payload["spans_per_rollout"] > payload["server_spans_per_rollout"] > 0
    assert payload["server_spans_per_rollout"] == payload["http_requests_per_rollout"]
    assert payload["spans_per_checkpoint"] == on["checkpoint_spans"]
    # The headline figures are the windows' figures, and the ratio is theirs.
    assert payload["off_us_per_call"] == pytest.approx(off["us_per_call"], abs=1e-3)
    assert payload["on_us_per_call"] == pytest.approx(on["us_per_call"], abs=1e-3)
    assert payload["ratio"] == pytest.approx(
        payload["on_us_per_call"] / payload["off_us_per_call"], abs=1e-3
    )
    assert payload["round_ratios"] == [pytest.approx(payload["ratio"], abs=2e-3)]
    assert payload["overhead_us_per_call"] == pytest.approx(
        payload["on_us_per_call"] - payload["off_us_per_call"], abs=1e-3
    )
    assert payload["off_cpu_us_per_call"] > 0 and payload["on_cpu_us_per_call"] > 0
    assert payload["checkpoint_off_s"] > 0 and payload["checkpoint_on_s"] > 0
    assert off["checkpoint_cut"] == on["checkpoint_cut"] == SMALL["parked"], "every call cut"
    assert only["checkpoint_cut"] == SMALL["parked"]
    micro = payload["span_call"]
    assert micro["span_off_ns"] > 0 and micro["nullcontext_ns"] > 0
    assert micro["span_on_ns"] > micro["span_off_ns"]


def test_the_command_prints_the_suite_as_json(tmp_path: Path) -> None:
    options = [f"--{name}={value}" for name, value in SMALL.items()]
    done = run_child(["-m", "e2e", "bench", "tracing", *options, "--dir", str(tmp_path), "--json"])
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    for key in (
        "suite",
        "parking",
        "floor",
        "loadavg",
        "rounds",
        "rollouts",
        "concurrency",
        "off_us_per_call",
        "on_us_per_call",
        "overhead_us_per_call",
        "ratio",
        "off_cpu_us_per_call",
        "on_cpu_us_per_call",
        "checkpoint_off_s",
        "checkpoint_on_s",
        "spans_per_rollout",
        "spans_per_checkpoint",
        "windows",
    ):
        assert key in payload, key
    assert (payload["rollouts"], payload["concurrency"], payload["rounds"]) == (6, 2, 1)
    assert payload["spans_per_rollout"] > 0 and payload["spans_per_checkpoint"] > 0
    assert list(tmp_path.iterdir()) == [], "the scratch directory is removed"


@pytest.mark.parametrize(
    ("options", "names"),
    [(["--rollouts", "0"], "--rollouts"), (["--dir", "/nonexistent/bench"], "--dir")],
)
def test_a_usage_error_is_one_line_and_exit_2(options: list[str], names: str) -> None:
    result = CliRunner().invoke(build_app(), ["bench", "tracing", *options, "--json"])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and names in result.stderr
