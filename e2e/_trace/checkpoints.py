"""A trace directory read as checkpoints and restores: what ``midflight trace`` prints and draws.

One checkpoint is one trace (``protocols._tracing`` draws its tree). The spans of a trace come
from several processes' files and are grouped here by ``trace_id``. A trace is a checkpoint when
it has the ``gym.checkpoint.collection.checkpoint`` root, or, the root missing (the coordinator
was killed before it ended), spans carrying ``nemo.gym.checkpoint.id`` from a prepare or a commit.
A trace is a restore when it has the ``gym.checkpoint.collection.restore`` root, or participant
restore spans and no checkpoint root; it is matched to its checkpoint by the root's link, or,
the root missing, by the checkpoint id its spans carry.

Every figure is derived from the spans that are there: a killed process leaves orphans (spans
whose parent never ended), and nothing here requires a parent, a root or a linked checkpoint to
be in the directory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocols import (
    COLLECTION_CHECKPOINT_SPAN,
    GENERATION_CUT_SPAN,
    OPERATIONS,
    WAIT_READY_SPAN,
    coordinate_span,
    operation_span,
)

from .restores import Restore, is_restore, restore_of
from .spans import (
    Lane,
    Span,
    attribute_of,
    checkpoint_id_of,
    int_attribute_of,
    lanes_of,
    participant_spans,
    root_of,
    span_from_line,
)
from .spans_file import read_span_lines

PauseBasis = Literal["prepare_to_resume", "root", "spans"]
"""What ``pause_s`` was measured from: the participants' prepare→resume, the root, every span."""

_OPERATION_SPANS = {operation_span(operation): operation for operation in OPERATIONS}
_STAGE_PREFIX = coordinate_span("")
_PREPARE_ENVELOPE = coordinate_span("prepare")
_CUT_COUNTS = ("calls", "cut", "cut_failed", "cut_skipped", "workers")


@dataclass(frozen=True)
class Stage:
    """One stage the coordinator drove (``prepare/model``, ``commit``, ``publish``, ``resume``).

    Attributes:
        name: The stage's name.
        start_s: Start, seconds after the checkpoint started.
        end_s: End, seconds after the checkpoint started.
    """

    name: str
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        """How long the stage lasted."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class CutRound:
    """One generation-cut round of a policy server's prepare, with the counts it reported.

    Attributes:
        participant: The policy server's name.
        start_s: Start, seconds after the checkpoint started.
        seconds: How long the round lasted.
        counts: ``calls``, ``cut``, ``cut_failed``, ``cut_skipped``, ``workers`` (``None`` when
            the span did not report one).
    """

    participant: str
    start_s: float
    seconds: float
    counts: Mapping[str, int | None]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's trace, summarized; ``spans`` and ``lanes`` are what the timeline draws.

    Attributes:
        checkpoint_id: The checkpoint id (``nemo.gym.checkpoint.id``).
        trace_id: The trace's id.
        start_ns: The root's start, or the earliest span's when the root is missing.
        root_seen: Whether the ``collection.checkpoint`` root is in the directory.
        published: The root's ``published``; else ``True`` when a publish stage is there, and
            ``None`` (unknown) when neither is.
        rollouts: The root's ``rollouts``, or ``None``.
        participants: Sorted names of the participant servers seen.
        lanes: The processes, top to bottom.
        pause_start_s: When admission closed, seconds after ``start_ns``.
        pause_s: How long admission stayed closed.
        pause_basis: What the pause was measured from.
        stages: The coordinator's stages, in order of start.
        blockers: Participant → blockers its prepare reported (only those with some).
        cuts: The generation-cut rounds, in order of start.
        refusals: Participant operations whose ``outcome`` was not ``ok``.
        restores: Trace ids of the restores of this checkpoint.
        spans: Every span of the trace.
    """

    checkpoint_id: str
    trace_id: str
    start_ns: int
    root_seen: bool
    published: bool | None
    rollouts: int | None
    participants: tuple[str, ...]
    lanes: tuple[Lane, ...]
    pause_start_s: float
    pause_s: float
    pause_basis: PauseBasis
    stages: tuple[Stage, ...]
    blockers: Mapping[str, int]
    cuts: tuple[CutRound, ...]
    refusals: tuple[Mapping[str, str | None], ...]
    restores: tuple[str, ...]
    spans: tuple[Span, ...]

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as ``midflight trace --json`` prints it (times rounded to the µs)."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "trace_id": self.trace_id,
            "start_ns": self.start_ns,
            "root_seen": self.root_seen,
            "published": self.published,
            "rollouts": self.rollouts,
            "participants": list(self.participants),
            "lanes": [lane.to_json() for lane in self.lanes],
            "pause_s": _round(self.pause_s),
            "pause_basis": self.pause_basis,
            "stages": [
                {
                    "name": stage.name,
                    "start_s": _round(stage.start_s),
                    "end_s": _round(stage.end_s),
                    "seconds": _round(stage.seconds),
                }
                for stage in self.stages
            ],
            "blockers": {"total": sum(self.blockers.values()), "participants": dict(self.blockers)},
            "cuts": [
                {
                    "participant": cut.participant,
                    "start_s": _round(cut.start_s),
                    "seconds": _round(cut.seconds),
                    **cut.counts,
                }
                for cut in self.cuts
            ],
            "refusals": [dict(refusal) for refusal in self.refusals],
            "restores": list(self.restores),
        }


@dataclass(frozen=True)
class TraceDirectory:
    """Every checkpoint and restore of a trace directory, each list in order of start.

    Attributes:
        checkpoints: The checkpoints.
        restores: The restores.
        span_count: Spans read in all (those of other traces included).
    """

    checkpoints: tuple[Checkpoint, ...]
    restores: tuple[Restore, ...]
    span_count: int

    def find(self, checkpoint_id: str | None) -> Checkpoint | None:
        """The checkpoint with this id (or trace id), the latest one when ``None``."""
        if checkpoint_id is None:
            return self.checkpoints[-1] if self.checkpoints else None
        matches = [
            checkpoint
            for checkpoint in self.checkpoints
            if checkpoint_id in (checkpoint.checkpoint_id, checkpoint.trace_id)
        ]
        return matches[-1] if matches else None


def timeline_file(directory: Path, checkpoint: Checkpoint) -> Path:
    """``DIR/timeline-<id>.png``: beside the spans it was drawn from, one file per checkpoint."""
    return directory / f"timeline-{re.sub(r'[^A-Za-z0-9_.-]+', '_', checkpoint.checkpoint_id)}.png"


def _round(seconds: float) -> float:
    return round(seconds, 6)


def _pause(
    spans: Sequence[Span], by_server: Mapping[str, list[Span]], root: Span | None
) -> tuple[int, int, PauseBasis]:
    mine = [span for own in by_server.values() for span in own]
    prepares = [span.start_ns for span in mine if span.name == operation_span("prepare")]
    resumes = [span.end_ns for span in mine if span.name == operation_span("resume")]
    if prepares and resumes and max(resumes) >= min(prepares):
        return min(prepares), max(resumes), "prepare_to_resume"
    if root is not None:
        return root.start_ns, root.end_ns, "root"
    return min(span.start_ns for span in spans), max(span.end_ns for span in spans), "spans"


def _stages(spans: Sequence[Span], start_ns: int) -> tuple[Stage, ...]:
    coordinated = [span for span in spans if span.name.startswith(_STAGE_PREFIX)]
    has_kinds = any(span.name.startswith(_PREPARE_ENVELOPE + ".") for span in coordinated)
    stages = [
        Stage(
            name=span.name.removeprefix(_STAGE_PREFIX).replace("prepare.", "prepare/", 1),
            start_s=(span.start_ns - start_ns) / 1e9,
            end_s=(span.end_ns - start_ns) / 1e9,
        )
        for span in coordinated
        # The prepare envelope is the sum of its stages: drawn only when they are missing.
        if not (has_kinds and span.name == _PREPARE_ENVELOPE)
    ]
    return tuple(sorted(stages, key=lambda stage: (stage.start_s, stage.name)))


def _blockers(by_server: Mapping[str, list[Span]]) -> dict[str, int]:
    found: dict[str, int] = {}
    for server, own in sorted(by_server.items()):
        # The prepare's own count when it has one; else what its wait_ready reported.
        for name in (operation_span("prepare"), WAIT_READY_SPAN):
            counts = [int_attribute_of(span, "blockers") for span in own if span.name == name]
            if known := [count for count in counts if count is not None]:
                if max(known) > 0:
                    found[server] = max(known)
                break
    return found


def _cuts(by_server: Mapping[str, list[Span]], start_ns: int) -> tuple[CutRound, ...]:
    rounds = [
        CutRound(
            participant=server,
            start_s=(span.start_ns - start_ns) / 1e9,
            seconds=span.seconds,
            counts={name: int_attribute_of(span, name) for name in _CUT_COUNTS},
        )
        for server, own in by_server.items()
        for span in own
        if span.name == GENERATION_CUT_SPAN
    ]
    return tuple(sorted(rounds, key=lambda cut: (cut.start_s, cut.participant)))


def _refusals(by_server: Mapping[str, list[Span]]) -> tuple[dict[str, str | None], ...]:
    refusals = []
    for server, own in sorted(by_server.items()):
        for span in sorted(own, key=lambda span: span.start_ns):
            outcome = attribute_of(span, "outcome")
            if span.name in _OPERATION_SPANS and isinstance(outcome, str) and outcome != "ok":
                code = attribute_of(span, "code")
                refusals.append(
                    {
                        "participant": server,
                        "operation": _OPERATION_SPANS[span.name],
                        "outcome": outcome,
                        "code": code if isinstance(code, str) else None,
                    }
                )
    return tuple(refusals)


def _checkpoint(trace_id: str, spans: Sequence[Span], restores: tuple[str, ...]) -> Checkpoint:
    root = root_of(spans, COLLECTION_CHECKPOINT_SPAN)
    lanes = lanes_of(spans)
    by_server = participant_spans(spans, lanes)
    start_ns = root.start_ns if root is not None else min(span.start_ns for span in spans)
    pause_from, pause_to, basis = _pause(spans, by_server, root)
    stages = _stages(spans, start_ns)
    published = None if root is None else attribute_of(root, "published")
    if not isinstance(published, bool):
        published = True if any(stage.name == "publish" for stage in stages) else None
    checkpoint_id = checkpoint_id_of(spans, root)
    return Checkpoint(
        checkpoint_id=checkpoint_id if checkpoint_id is not None else f"unknown-{trace_id[:8]}",
        trace_id=trace_id,
        start_ns=start_ns,
        root_seen=root is not None,
        published=published,
        rollouts=None if root is None else int_attribute_of(root, "rollouts"),
        participants=tuple(sorted(by_server)),
        lanes=lanes,
        pause_start_s=(pause_from - start_ns) / 1e9,
        pause_s=(pause_to - pause_from) / 1e9,
        pause_basis=basis,
        stages=stages,
        blockers=_blockers(by_server),
        cuts=_cuts(by_server, start_ns),
        refusals=_refusals(by_server),
        restores=restores,
        spans=tuple(sorted(spans, key=lambda span: (span.start_ns, span.name))),
    )


def _is_checkpoint(spans: Sequence[Span]) -> bool:
    names = {span.name for span in spans}
    if COLLECTION_CHECKPOINT_SPAN in names:
        return True
    marks = {operation_span("prepare"), operation_span("commit"), coordinate_span("commit")}
    started = bool(names & marks) or any(name.startswith(_PREPARE_ENVELOPE) for name in names)
    return started and any(attribute_of(span, "id") is not None for span in spans)


def trace_directory_of(lines: Iterable[Mapping[str, Any]]) -> TraceDirectory:
    """The checkpoints and restores of these span lines (other traces are counted, not kept)."""
    traces: dict[str, list[Span]] = {}
    count = 0
    for line in lines:
        if (span := span_from_line(line)) is not None:
            traces.setdefault(span.trace_id, []).append(span)
            count += 1
    checkpoint_traces = {
        trace_id: spans
        for trace_id, spans in traces.items()
        if not is_restore(spans) and _is_checkpoint(spans)
    }
    starts = sorted(
        (
            min(span.start_ns for span in spans)
            if (root := root_of(spans, COLLECTION_CHECKPOINT_SPAN)) is None
            else root.start_ns,
            trace_id,
            checkpoint_id_of(spans, root),
        )
        for trace_id, spans in checkpoint_traces.items()
    )
    index = [(trace_id, checkpoint_id, start) for start, trace_id, checkpoint_id in starts]
    restores = sorted(
        (
            restore_of(trace_id, spans, index)
            for trace_id, spans in traces.items()
            if is_restore(spans)
        ),
        key=lambda restore: (restore.start_ns, restore.trace_id),
    )
    checkpoints = tuple(
        _checkpoint(
            trace_id,
            checkpoint_traces[trace_id],
            tuple(r.trace_id for r in restores if r.checkpoint_trace_id == trace_id),
        )
        for trace_id, _, _ in index
    )
    return TraceDirectory(checkpoints, tuple(restores), count)


def read_trace_directory(directory: Path) -> TraceDirectory:
    """The checkpoints and restores of every spans file in ``directory``."""
    return trace_directory_of(read_span_lines(directory))
