"""Span lines as typed spans, and the process that wrote each one as a lane of the timeline.

Every process of a traced run writes its own spans file, and every line carries the process's
resource (``midflight.server``, ``midflight.process``, ``process.pid``, ``service.name``), so a
lane is one (server, process, pid): the coordinator (the driver), a participant server's main
process, each of its shard processes, each inference worker. The timeline draws them top to
bottom in that order.

A line that does not parse as a span (a foreign line, a field of the wrong type) is skipped here,
as :func:`~e2e._trace.spans_file.read_span_lines` skips a torn one: a trace directory is evidence
from processes that may have been killed, and one bad line must not hide the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from protocols import (
    COLLECTION_CHECKPOINT_SPAN,
    COLLECTION_RESTORE_SPAN,
    WORKER_CUT_SPAN,
    attribute,
)

Role = Literal["coordinator", "participant", "worker"]
"""What a lane's process is: the coordinator, a participant (main or shard), an inference worker."""

_ROLE_ORDER: Final[dict[Role, int]] = {"coordinator": 0, "participant": 1, "worker": 2}
_COORDINATOR_PREFIXES: Final = ("gym.checkpoint.coordinate.", "gym.checkpoint.collection.")
_SERVICE_PREFIX: Final = "midflight-"


@dataclass(frozen=True)
class Process:
    """The process that wrote a span, from the line's resource attributes.

    Attributes:
        server: The server's name (``midflight.server``: ``model``, ``driver``, …).
        process: ``main`` or ``shard`` (``midflight.process``).
        pid: The process id (``process.pid``), or ``None`` when the line has none.
        service: The ``service.name`` (``midflight-model``, ``midflight-driver``, …).
    """

    server: str
    process: str
    pid: int | None
    service: str


@dataclass(frozen=True)
class Span:
    """One finished span of the trace directory.

    Attributes:
        name: The span's name (``gym.checkpoint.prepare``, …).
        trace_id: 32 hex digits.
        span_id: 16 hex digits.
        parent_span_id: The parent's span id, or ``None`` for a root. The parent may be absent
            from the directory (its process was killed before the parent ended).
        start_ns: Start, nanoseconds since the epoch.
        end_ns: End, nanoseconds since the epoch.
        attributes: The span's attributes.
        links: ``(trace_id, span_id)`` of each linked span (a restore links its checkpoint).
        process: The process that wrote it.
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    links: tuple[tuple[str, str], ...]
    process: Process

    @property
    def seconds(self) -> float:
        """How long the span lasted."""
        return (self.end_ns - self.start_ns) / 1e9


def _server_of(resource: Mapping[str, Any], service: str) -> str:
    server = resource.get("midflight.server")
    if isinstance(server, str) and server:
        return server
    # A process configured by hand (no midflight resource): its service name is the best name.
    return service.removeprefix(_SERVICE_PREFIX) or "unknown"


def process_of(resource: Mapping[str, Any]) -> Process:
    """The process a line's ``resource`` names, with fallbacks for missing attributes."""
    service = resource.get("service.name")
    service = service if isinstance(service, str) else "unknown"
    process = resource.get("midflight.process")
    pid = resource.get("process.pid")
    return Process(
        server=_server_of(resource, service),
        process=process if isinstance(process, str) and process else "main",
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        service=service,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def span_from_line(line: Mapping[str, Any]) -> Span | None:
    """The span one line holds, or ``None`` when the line is not one (a field missing or mistyped)."""
    name, trace_id, span_id = line.get("name"), line.get("trace_id"), line.get("span_id")
    start_ns, end_ns = line.get("start_ns"), line.get("end_ns")
    if not (isinstance(name, str) and isinstance(trace_id, str) and isinstance(span_id, str)):
        return None
    if not (isinstance(start_ns, int) and isinstance(end_ns, int)):
        return None
    if isinstance(start_ns, bool) or isinstance(end_ns, bool):
        return None
    parent = line.get("parent_span_id")
    attributes = line.get("attributes")
    resource = line.get("resource")
    links: list[tuple[str, str]] = []
    for link in line.get("links") or ():
        if isinstance(link, Mapping):
            linked_trace, linked_span = link.get("trace_id"), link.get("span_id")
            if isinstance(linked_trace, str) and isinstance(linked_span, str):
                links.append((linked_trace, linked_span))
    return Span(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent if isinstance(parent, str) else None,
        start_ns=start_ns,
        end_ns=max(start_ns, end_ns),
        attributes=attributes if isinstance(attributes, Mapping) else {},
        links=tuple(links),
        process=process_of(resource if isinstance(resource, Mapping) else {}),
    )


@dataclass(frozen=True)
class Lane:
    """One row of the timeline: one process's spans.

    Attributes:
        process: The process.
        role: What the process is in the checkpoint.
        label: The row's name (``model``, ``model shard 1234``, ``driver``, ``worker``).
    """

    process: Process
    role: Role
    label: str

    def to_json(self) -> dict[str, Any]:
        """The lane as ``midflight trace --json`` prints it."""
        return {
            "label": self.label,
            "role": self.role,
            "server": self.process.server,
            "process": self.process.process,
            "pid": self.process.pid,
            "service": self.process.service,
        }


def _role_of(process: Process, names: set[str]) -> Role:
    if process.service == f"{_SERVICE_PREFIX}driver" or any(
        name.startswith(_COORDINATOR_PREFIXES)
        or name in (COLLECTION_CHECKPOINT_SPAN, COLLECTION_RESTORE_SPAN)
        for name in names
    ):
        return "coordinator"
    if process.service == f"{_SERVICE_PREFIX}worker" or WORKER_CUT_SPAN in names:
        return "worker"
    return "participant"


def _base_label(process: Process) -> str:
    if process.process == "main":
        return process.server
    return f"{process.server} {process.process} {process.pid if process.pid is not None else '?'}"


def lanes_of(spans: Iterable[Span]) -> tuple[Lane, ...]:
    """The lanes of ``spans`` top to bottom: the coordinator, the participants, the workers.

    Participants are sorted by server, each main process above its shards. Two processes with
    the same label (a server restarted under a new pid) get the pid appended, so no two rows
    share a name.
    """
    names: dict[Process, set[str]] = {}
    for span in spans:
        names.setdefault(span.process, set()).add(span.name)
    lanes = [Lane(process, _role_of(process, seen), "") for process, seen in names.items()]
    lanes.sort(
        key=lambda lane: (
            _ROLE_ORDER[lane.role],
            lane.process.server,
            lane.process.process != "main",
            lane.process.pid if lane.process.pid is not None else -1,
        )
    )
    labels = [_base_label(lane.process) for lane in lanes]
    return tuple(
        Lane(
            lane.process,
            lane.role,
            label if labels.count(label) == 1 else f"{label} (pid {lane.process.pid})",
        )
        for lane, label in zip(lanes, labels, strict=True)
    )


def attribute_of(span: Span, name: str) -> Any:
    """The span's ``nemo.gym.checkpoint.<name>`` attribute, or ``None``."""
    return span.attributes.get(attribute(name))


def int_attribute_of(span: Span, name: str) -> int | None:
    """The span's ``nemo.gym.checkpoint.<name>`` attribute when it is an integer, else ``None``."""
    value = attribute_of(span, name)
    return value if _is_int(value) else None


def root_of(spans: Sequence[Span], name: str) -> Span | None:
    """The earliest span named ``name`` (a trace's root), or ``None`` when it is missing."""
    roots = [span for span in spans if span.name == name]
    return min(roots, key=lambda span: span.start_ns) if roots else None


def checkpoint_id_of(spans: Sequence[Span], root: Span | None) -> str | None:
    """The root's checkpoint id; without one, the id most of the spans carry."""
    if root is not None and isinstance(found := attribute_of(root, "id"), str):
        return found
    ids = Counter(value for span in spans if isinstance(value := attribute_of(span, "id"), str))
    return ids.most_common(1)[0][0] if ids else None


def participant_spans(spans: Sequence[Span], lanes: Sequence[Lane]) -> dict[str, list[Span]]:
    """Participant server → its spans, its main and shard processes together."""
    server_of = {lane.process: lane.process.server for lane in lanes if lane.role == "participant"}
    by_server: dict[str, list[Span]] = {}
    for span in spans:
        if (server := server_of.get(span.process)) is not None:
            by_server.setdefault(server, []).append(span)
    return by_server
