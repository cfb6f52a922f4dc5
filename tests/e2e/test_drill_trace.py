"""A traced drill: each published checkpoint is one trace over every process; restores link to it.

``midflight drill --trace-dir DIR`` with two shard processes per server: real processes, real
SIGKILLs, every process appending its spans to DIR. Read back from the files alone, each
checkpoint the run published (its ``checkpoint.json`` names its trace) is exactly one trace that
holds spans of every participant server's main process and of each of its shard processes, and
each restore is a trace of its own, linked to the trace of the checkpoint it restored.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from e2e._trace.spans_file import read_span_lines
from protocols import COLLECTION_CHECKPOINT_SPAN, COLLECTION_RESTORE_SPAN, attribute

from .processes import drill_json

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]

PARTICIPANTS = {"environment", "policy", "agent", "resources"}
SHARDS = 2


def _drill(work: Path, traces: Path) -> dict[str, Any]:
    code, figures = drill_json(
        work,
        "--rollouts",
        "4",
        "--restart-only-share",
        "0",
        "--processes",
        str(SHARDS),
        "--trace-dir",
        str(traces),
        timeout=540,
    )
    assert code == 0, figures["failures"]
    return figures


def test_each_published_checkpoint_is_one_trace_over_every_process(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    figures = _drill(tmp_path / "work", traces)
    published: dict[str, str] = {}
    for manifest in sorted((tmp_path / "work" / "run" / "checkpoints").glob("*/checkpoint.json")):
        published[manifest.parent.name] = json.loads(manifest.read_text())["traceparent"]
    assert len(published) >= 3, "the drill publishes three checkpoints"
    lines = read_span_lines(traces)
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        by_trace[line["trace_id"]].append(line)
    checkpoint_traces: dict[str, str] = {}
    for checkpoint_id, traceparent in published.items():
        _version, trace_id, root_span_id, _flags = traceparent.split("-")
        spans = by_trace[trace_id]
        roots = [s for s in spans if s["name"] == COLLECTION_CHECKPOINT_SPAN]
        assert [(r["span_id"], r["parent_span_id"]) for r in roots] == [(root_span_id, None)]
        # Every span naming this checkpoint is in this one trace.
        named = {
            s["trace_id"] for s in lines if s["attributes"].get(attribute("id")) == checkpoint_id
        }
        assert named == {trace_id}, f"{checkpoint_id} is spread over {len(named)} traces"
        processes: dict[str, set[tuple[str, int]]] = defaultdict(set)
        for span in spans:
            resource = span["resource"]
            processes[resource["midflight.server"]].add(
                (resource["midflight.process"], resource["process.pid"])
            )
        for server in PARTICIPANTS:
            kinds = [kind for kind, _pid in processes[server]]
            assert kinds.count("main") == 1, f"{checkpoint_id}: {server}'s main process"
            assert kinds.count("shard") == SHARDS, f"{checkpoint_id}: {server}'s shards {kinds}"
        assert "driver" in processes
        checkpoint_traces[checkpoint_id] = trace_id
    restores = [s for s in lines if s["name"] == COLLECTION_RESTORE_SPAN]
    assert len(restores) == 2, "one restore after each of the drill's two crashes"
    for restore in restores:
        source = restore["attributes"][attribute("source")]
        assert restore["parent_span_id"] is None and restore["trace_id"] not in checkpoint_traces
        assert [link["trace_id"] for link in restore["links"]] == [checkpoint_traces[source]]
    assert figures["trace_checkpoints"] == len(published)
    assert figures["trace_checkpoints_whole"] == len(published)
    assert figures["trace_restores_linked"] == len(restores)
    assert Path(figures["trace_timeline"]).read_bytes().startswith(b"\x89PNG")
