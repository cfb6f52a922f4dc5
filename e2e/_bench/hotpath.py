"""The policy server's hot path: CPU per captured call, step by step, with fsync stubbed out.

A captured call passes four steps on the policy server: **admit** (the gate's ticket and the
request's conversation digest), **resolve** (the ledger's lineage matcher and the worker's
admission), **record** (the custody row built from the worker's coordinates and appended through
the group commit) and **egress** (the gate's delivery and the ticket's release). Between resolve
and record the worker's request is encoded and its reply decoded (**worker_codec**); the network
itself is left out. The steps run the server's own code (``e2e._servers.policy_server`` and the
capture protocol it calls, ``participants.resolve_admission`` / ``record_custody``) against a
capture ledger of either layout (``SqliteCaptureLedger`` by default, ``FileCaptureLedger``) in a
scratch directory, each rollout's calls in order with a conversation that grows by an
assistant and a tool item per call. By default one call runs at a time; with ``in_flight`` N the
rollouts run in waves of N, each step taken by every call of a wave together (D427), which is
what a server with N calls in flight pays per call: a busy loop, batched group commits, and a
garbage collector walking every call's objects. ``gc_us_per_call`` says how much of the steps'
CPU went into the collector's collections.

``os.fsync`` is replaced by a no-op for the whole run (the SQLite layout runs with
``synchronous=OFF``, its own way of not syncing), so the figures are what the server spends
on the CPU, not what the disk spends: process CPU time (every thread, the shard threads of the
group commit included), read before and after each step.

The floor is what any call must do under "no blocking file work on the event loop": one read of
the ledger file (open, read, close) and one append (open, write, close), each through one bare
event loop → thread → event loop round trip, alternated call by call with ours; for a wave, its
reads in one round trip and then its appends in another, alternated turn by turn.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import anyio

from participants import (
    FileCaptureLedger,
    ModelParticipant,
    ModelTicket,
    SqliteCaptureLedger,
    record_custody,
    resolve_admission,
)
from protocols import (
    CaptureAdmission,
    CompletionReply,
    EpisodeId,
    RequestItem,
    as_request_items,
    conversation_digest,
)

from .._launch.loop_watch import GcClock
from .ledger_floors import _ThreadHop

STEPS: Final = ("admit", "resolve", "worker_codec", "record", "egress")
DELTA: Final = 32
"""Tokens each call adds (the coordinates' ``delta_len``)."""


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@contextlib.contextmanager
def fsync_stubbed() -> Iterator[None]:
    """``os.fsync`` does nothing inside the block (CPU figures, not disk figures)."""
    real = os.fsync

    def no_sync(fd: int | Any) -> None:
        del fd

    os.fsync = no_sync
    try:
        yield
    finally:
        os.fsync = real


def _reply_json(admission: Any, turn: int) -> bytes:
    """The worker's reply to ``admission``: 32 tokens and staged coordinates."""
    key, call = admission.rollout_id, admission.model_call_id
    coords = {
        "rollout_id": key,
        "model_call_id": call,
        "parent_call_id": admission.parent_call_id,
        "prev_len": admission.prev_len,
        "delta_len": DELTA,
        "cum_len": admission.prev_len + DELTA,
        "weight_version": 1,
        "disposition": "staged",
        "digest": _hex("d", key, call),
        "extras_digest": _hex("e"),
        "staging_key": f"staging/{key}/{call}",
        "chain_hash": _hex("c", key, call),
        "cumulative_hash": _hex("h", key, call),
    }
    tokens = list(range(turn, turn + DELTA))
    return (
        CompletionReply.model_validate(
            {"token_ids": tokens, "finish_reason": "stop", "ng_commit_coords": coords}
        )
        .model_dump_json()
        .encode()
    )


class _FloorFiles:
    """The floor's system calls: one read and one append per call, fsync stubbed like ours."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.prefix = f"{root}{os.sep}"

    def read(self, key: str) -> None:
        try:
            fd = os.open(f"{self.prefix}{key}.lineage.jsonl", os.O_RDONLY)
        except FileNotFoundError:
            return
        os.read(fd, 1 << 20)
        os.close(fd)

    def append(self, key: str, line: bytes) -> None:
        fd = os.open(
            f"{self.prefix}{key}.lineage.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644
        )
        os.write(fd, line)
        os.fsync(fd)
        os.close(fd)

    def read_many(self, keys: list[str]) -> None:
        for key in keys:
            self.read(key)

    def append_many(self, keys: list[str], line: bytes) -> None:
        for key in keys:
            self.append(key, line)


@dataclass
class _Call:
    """One rollout's call going through the steps, and its conversation so far."""

    key: str
    messages: list[dict[str, str]]
    ticket: ModelTicket | None = None
    items: list[RequestItem] = field(default_factory=list)
    admission: CaptureAdmission | None = None
    reply: CompletionReply | None = None

    @classmethod
    def first(cls, key: str) -> _Call:
        return cls(
            key, [{"role": "system", "content": "counter"}, {"role": "user", "content": f"{key} 0"}]
        )


async def _admit(participant: ModelParticipant, call: _Call) -> None:
    call.ticket = await participant.admit(EpisodeId.from_capture_key(call.key))
    call.items = as_request_items(call.messages)  # as PolicyServer.serve does
    call.ticket.request_digest = conversation_digest(call.items)


async def _resolve(participant: ModelParticipant, call: _Call) -> None:
    assert call.ticket is not None
    call.admission = await resolve_admission(
        participant.ledger, call.key, call.ticket.model_call_id, call.items
    )
    assert call.admission is not None, f"the parent of {call.ticket.model_call_id} did not resolve"


def _codec(call: _Call, turn: int) -> float:
    """Encode the worker's request and decode its reply; the seconds of the worker's own work
    (building the reply), which are not ours and are taken out of the step."""
    assert call.admission is not None
    call.admission.model_dump(mode="json")
    pause = time.process_time()
    body = _reply_json(call.admission, turn)
    worker = time.process_time() - pause
    call.reply = CompletionReply.model_validate_json(body)
    return worker


async def _record(participant: ModelParticipant, call: _Call, *, turn: int) -> None:
    assert call.ticket is not None
    assert call.admission is not None
    assert call.reply is not None
    commit = await record_custody(
        participant.ledger,
        call.admission,
        call.reply.ng_commit_coords,
        request_items=call.items,
        response_items=[{"role": "assistant", "content": _content(call.key, turn)}],
        response_id=f"resp_{call.ticket.model_call_id}",
        admitted_at=call.ticket.admitted_at,
        context_digest=call.ticket.request_digest,  # as the policy server does (D429)
    )
    assert commit is not None, "the worker's coordinates did not become a custody row"


async def _egress(participant: ModelParticipant, call: _Call) -> None:
    assert call.ticket is not None
    await participant.gate.deliver(call.ticket)
    participant.release(call.ticket)


def _content(key: str, turn: int) -> str:
    return f"completion {turn} of {key}"


def _tool_output(turn: int, size: int) -> str:
    text = f"add {turn} -> {turn + 1} 0"
    return text + " " * (size - len(text)) if size > len(text) else text


def run_hotpath_bench(
    directory: Path,
    *,
    rollouts: int,
    calls: int = 4,
    layout: str = "sqlite",
    in_flight: int = 1,
    tool_bytes: int = 0,
) -> dict[str, Any]:
    """CPU µs per captured call and each step's share, beside the floor.

    Args:
        directory: An empty scratch directory.
        rollouts: How many rollouts (each with ``calls`` captured calls, in order).
        calls: Calls per rollout.
        layout: The capture ledger's layout, ``sqlite`` or ``file``.
        in_flight: Rollouts served at once (D427). 1 serves one call at a time; more runs the
            rollouts in waves of this many, every call of a wave through each step together
            (its resolves and records at once), as a server with that many in flight does.
        tool_bytes: Each tool item's content is padded to this many bytes (a tool's output):
            the conversation, which every call hashes, grows by as much a call (D429).
    """
    if rollouts < 1 or calls < 1 or in_flight < 1 or tool_bytes < 0:
        raise ValueError("rollouts, calls and in_flight must be positive, tool_bytes not negative")
    cpu = dict.fromkeys(STEPS, 0.0)
    wall_s = 0.0
    floor_cpu = 0.0
    floor_wall = 0.0
    floor = _FloorFiles(directory / "floor")
    line = b'{"model_call_id":"floor"}\n' * 20  # about one custody row's length
    hop = _ThreadHop()
    clock = time.process_time
    collector = GcClock(clock=time.thread_time)  # CPU, as the steps are counted
    gc_s = 0.0
    gc_collections = 0

    async def wave(participant: ModelParticipant, keys: list[str]) -> None:
        """Every call of the wave's rollouts, turn by turn, each step for all of them at once
        (one call at a time for a wave of one); then the floor's calls for the same keys."""
        nonlocal wall_s, floor_cpu, floor_wall, gc_s, gc_collections
        group = [_Call.first(key) for key in keys]
        for turn in range(calls):
            started = time.perf_counter()
            collected = collector.seconds, collector.collections
            marks = [clock()]
            for call in group:
                await _admit(participant, call)
            marks.append(clock())
            await _each(group, partial(_resolve, participant))
            marks.append(clock())
            worker = sum(_codec(call, turn) for call in group)  # not ours: taken out from here
            marks.append(clock() - worker)
            await _each(group, partial(_record, participant, turn=turn))
            marks.append(clock() - worker)
            for call in group:
                await _egress(participant, call)
            marks.append(clock() - worker)
            wall_s += time.perf_counter() - started
            gc_s += collector.seconds - collected[0]
            gc_collections += collector.collections - collected[1]
            for step, (begin, end) in zip(STEPS, itertools.pairwise(marks), strict=True):
                cpu[step] += end - begin
            for call in group:
                call.messages = [
                    *call.messages,
                    {"role": "assistant", "content": _content(call.key, turn)},
                    {"role": "tool", "content": _tool_output(turn, tool_bytes)},
                ]
            started, started_cpu = time.perf_counter(), clock()
            # The least a wave can do (a call, for a wave of one): its reads, then its appends,
            # one round trip each.
            await hop.run(partial(floor.read_many, keys))
            await hop.run(partial(floor.append_many, keys, line))
            floor_cpu += clock() - started_cpu
            floor_wall += time.perf_counter() - started

    async def main() -> None:
        ledger: FileCaptureLedger | SqliteCaptureLedger = (
            SqliteCaptureLedger(directory / "ledger", synchronous="OFF")
            if layout == "sqlite"
            else FileCaptureLedger(directory / "ledger")
        )
        participant = ModelParticipant(ledger)
        try:
            for first in range(0, rollouts, in_flight):
                last = min(first + in_flight, rollouts)
                await wave(participant, [f"rollout-{index}" for index in range(first, last)])
        finally:
            ledger.close()

    gc.collect()
    with fsync_stubbed(), hop, collector:
        anyio.run(main)
    total = sum(cpu.values())
    n = rollouts * calls
    return {
        "rollouts": rollouts,
        "calls_per_rollout": calls,
        "calls": n,
        "in_flight": in_flight,
        "tool_bytes": tool_bytes,
        "layout": layout,
        "fsync": "stubbed",
        "cpu_us_per_call": round(total / n * 1e6, 2),
        "wall_us_per_call": round(wall_s / n * 1e6, 2),
        "floor_cpu_us_per_call": round(floor_cpu / n * 1e6, 2),
        "floor_wall_us_per_call": round(floor_wall / n * 1e6, 2),
        "ratio": round(total / floor_cpu, 3) if floor_cpu > 0 else None,
        # Inside the steps' figures: the cyclic garbage collector's share of them (D427).
        "gc_us_per_call": round(gc_s / n * 1e6, 2),
        "gc_collections": gc_collections,
        "steps": [
            {
                "step": step,
                "cpu_us_per_call": round(cpu[step] / n * 1e6, 2),
                "share": round(cpu[step] / total, 3) if total > 0 else None,
            }
            for step in STEPS
        ],
    }


async def _each(group: list[_Call], step: Callable[[_Call], Coroutine[Any, Any, None]]) -> None:
    """Run ``step`` for one call, or for every call of a wave at once."""
    if len(group) == 1:
        await step(group[0])
        return
    async with anyio.create_task_group() as tasks:
        for call in group:
            tasks.start_soon(step, call)
