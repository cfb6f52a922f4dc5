"""Restore traces: each restore is a trace of its own, matched here to the checkpoint it restored.

A restore's root (``gym.checkpoint.collection.restore``) links the root of the checkpoint's trace,
whose ids the coordinator read from ``checkpoint.json``. The root may be missing (the coordinator
was killed), and the linked checkpoint may be missing too (its spans are in another directory, or
were never written): a restore without a root is matched by the checkpoint id its participants'
spans carry, and one whose checkpoint is not in the directory says so instead of being dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from protocols import COLLECTION_CHECKPOINT_SPAN, COLLECTION_RESTORE_SPAN, operation_span

from .spans import Span, attribute_of, checkpoint_id_of, lanes_of, participant_spans, root_of


@dataclass(frozen=True)
class Restore:
    """One restore's trace, and the checkpoint it restored.

    Attributes:
        trace_id: The restore trace's id.
        restore_id: The id the restore's control calls used (``None`` when no span carries one).
        checkpoint_id: The id of the checkpoint restored: the root's ``source``, else that of the
            linked checkpoint, else the restore's own id (``None`` when none is known).
        checkpoint_trace_id: The trace of that checkpoint: the root's link, else the trace of
            the latest earlier checkpoint with that id in the directory, else ``None``.
        linked_by: ``link``, ``id`` or ``None``: how ``checkpoint_trace_id`` was found.
        checkpoint_in_directory: Whether that checkpoint's trace is in the directory.
        participants: Sorted names of the participant servers seen.
        start_ns: The root's start, or the earliest span's.
        seconds: The root's duration, or the spans' extent.
    """

    trace_id: str
    restore_id: str | None
    checkpoint_id: str | None
    checkpoint_trace_id: str | None
    linked_by: Literal["link", "id"] | None
    checkpoint_in_directory: bool
    participants: tuple[str, ...]
    start_ns: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The restore as ``midflight trace --json`` prints it."""
        return {
            "trace_id": self.trace_id,
            "restore_id": self.restore_id,
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_trace_id": self.checkpoint_trace_id,
            "linked_by": self.linked_by,
            "checkpoint_in_directory": self.checkpoint_in_directory,
            "participants": list(self.participants),
            "start_ns": self.start_ns,
            "seconds": round(self.seconds, 6),
        }


def is_restore(spans: Sequence[Span]) -> bool:
    """Whether one trace's spans are a restore: its root, or participant restores and no checkpoint root."""
    names = {span.name for span in spans}
    if COLLECTION_RESTORE_SPAN in names:
        return True
    return COLLECTION_CHECKPOINT_SPAN not in names and operation_span("restore") in names


def restore_of(
    trace_id: str, spans: Sequence[Span], checkpoints: Sequence[tuple[str, str | None, int]]
) -> Restore:
    """One restore trace, summarized and matched to its checkpoint.

    Args:
        trace_id: The restore's trace id.
        spans: Its spans (not empty).
        checkpoints: ``(trace id, checkpoint id, start_ns)`` of every checkpoint of the directory,
            in order of start: a restore without a root restored the latest one with its id that
            started before it.
    """
    root = root_of(spans, COLLECTION_RESTORE_SPAN)
    start_ns = root.start_ns if root is not None else min(span.start_ns for span in spans)
    end_ns = root.end_ns if root is not None else max(span.end_ns for span in spans)
    restore_id = checkpoint_id_of(spans, root)
    # The root names the checkpoint it restores; so does each participant's restore span.
    sources = [attribute_of(span, "source") for span in ([root] if root else []) + list(spans)]
    source = next((value for value in sources if isinstance(value, str)), None)
    checkpoint_id = source if source is not None else restore_id
    linked: str | None = None
    linked_by: Literal["link", "id"] | None = None
    if root is not None and root.links:
        linked, linked_by = root.links[0][0], "link"
        named = [c for t, c, _ in checkpoints if t == linked]
        if source is None and named and named[-1] is not None:
            checkpoint_id = named[-1]
    elif checkpoint_id is not None:
        earlier = [t for t, c, s in checkpoints if c == checkpoint_id and s <= start_ns]
        if earlier:
            linked, linked_by = earlier[-1], "id"
    return Restore(
        trace_id=trace_id,
        restore_id=restore_id,
        checkpoint_id=checkpoint_id,
        checkpoint_trace_id=linked,
        linked_by=linked_by,
        checkpoint_in_directory=linked in {trace for trace, _, _ in checkpoints},
        participants=tuple(sorted(participant_spans(spans, lanes_of(spans)))),
        start_ns=start_ns,
        seconds=(end_ns - start_ns) / 1e9,
    )
