"""What ``midflight drill --trace-dir DIR`` reports of the spans its processes wrote.

Every checkpoint the run published stores its trace's ``traceparent`` in ``checkpoint.json``; the
figures say how many of those traces are in the directory with spans from every participant
server, and how many restores link to a published checkpoint's trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator import CHECKPOINT_FILE, CHECKPOINTS_SUBDIR, CheckpointManifest
from protocols import COLLECTION_RESTORE_SPAN, SPAN_PREFIX, attribute, open_store

from .._trace.checkpoints import timeline_file, trace_directory_of
from .._trace.setup import SERVER_ATTRIBUTE
from .._trace.spans_file import read_span_lines
from .store import published_checkpoints

_KIND = attribute("participant_kind")


def published_traces(checkpoints_at: Path | str) -> dict[str, str]:
    """Checkpoint id → the trace id its ``checkpoint.json`` stores, for every published one."""
    store = open_store(checkpoints_at)
    traces: dict[str, str] = {}
    for checkpoint_id in published_checkpoints(checkpoints_at):
        key = f"{CHECKPOINTS_SUBDIR}/{checkpoint_id}/{CHECKPOINT_FILE}"
        try:
            stored = CheckpointManifest.model_validate_json(store.read(key)).traceparent
        except (OSError, ValidationError):
            continue
        if stored is not None and stored.count("-") == 3:
            traces[checkpoint_id] = stored.split("-")[1]
    return traces


def trace_figures(trace_dir: Path, checkpoints_at: Path | str) -> dict[str, Any]:
    """The trace figures of a drill run traced into ``trace_dir`` (its checkpoints under
    ``checkpoints_at``: the run directory, or its ``s3://`` root).

    ``trace_checkpoints_whole`` counts the published checkpoints whose trace holds spans from
    every participant server that took part in any checkpoint; ``trace_restores_linked`` the
    restore traces linked to a published checkpoint's trace.
    """
    lines = read_span_lines(trace_dir)
    published = published_traces(checkpoints_at)
    servers_by_trace: dict[str, set[str]] = {}
    participants: set[str] = set()
    linked = 0
    for line in lines:
        name = str(line.get("name", ""))
        server = str(line.get("resource", {}).get(SERVER_ATTRIBUTE, "?"))
        own = not name.startswith(f"{SPAN_PREFIX}call.")  # not the coordinator's client span
        if name.startswith(SPAN_PREFIX) and own and _KIND in line.get("attributes", {}):
            participants.add(server)
            servers_by_trace.setdefault(str(line["trace_id"]), set()).add(server)
        if name == COLLECTION_RESTORE_SPAN and any(
            link.get("trace_id") in published.values() for link in line.get("links", [])
        ):
            linked += 1
    whole = sum(
        1
        for trace_id in published.values()
        if servers_by_trace.get(trace_id, set()) >= participants
    )
    return {
        "trace_dir": str(trace_dir),
        "trace_spans": len(lines),
        "trace_checkpoints": len(published),
        "trace_checkpoints_whole": whole,
        "trace_restores_linked": linked,
        "trace_timeline": draw_last_published(lines, trace_dir, set(published.values())),
    }


def draw_last_published(
    lines: list[dict[str, Any]], trace_dir: Path, published: set[str]
) -> str | None:
    """Draw the last published checkpoint's timeline beside the spans; its path, if drawn."""
    found = [c for c in trace_directory_of(lines).checkpoints if c.trace_id in published]
    if not found:
        return None
    from .._trace.timeline import draw_timeline  # matplotlib, only when a picture is drawn

    return str(draw_timeline(found[-1], timeline_file(trace_dir, found[-1])))
