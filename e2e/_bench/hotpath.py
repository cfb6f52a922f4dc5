"""The policy server's hot path: CPU per captured call, step by step, with fsync stubbed out.

A captured call passes four steps on the policy server: **admit** (the gate's ticket and the
request's conversation digest), **resolve** (the ledger's lineage matcher and the worker's
admission), **record** (the custody row built from the worker's coordinates and appended through
the group commit) and **egress** (the gate's delivery and the ticket's release). Between resolve
and record the worker's request is encoded and its reply decoded (**worker_codec**); the network
itself is left out. The steps run the server's own code (``e2e._servers.policy_server`` and the
capture protocol it calls, ``participants.resolve_admission`` / ``record_custody``) against a
capture ledger of either layout (``SqliteCaptureLedger`` by default, ``FileCaptureLedger``) in a
scratch directory, one call at a time, each rollout's calls in order
with a conversation that grows by an assistant and a tool item per call.

``os.fsync`` is replaced by a no-op for the whole run (the SQLite layout runs with
``synchronous=OFF``, its own way of not syncing), so the figures are what the server spends
on the CPU, not what the disk spends: process CPU time (every thread, the shard threads of the
group commit included), read before and after each step.

The floor is what any call must do under "no blocking file work on the event loop": one read of
the ledger file (open, read, close) and one append (open, write, close), each through one bare
event loop → thread → event loop round trip, alternated call by call with ours.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, Final

import anyio

from participants import (
    FileCaptureLedger,
    ModelParticipant,
    SqliteCaptureLedger,
    record_custody,
    resolve_admission,
)
from protocols import CompletionReply, EpisodeId, as_request_items, conversation_digest

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


def run_hotpath_bench(
    directory: Path, *, rollouts: int, calls: int = 4, layout: str = "sqlite"
) -> dict[str, Any]:
    """CPU µs per captured call and each step's share, beside the floor.

    Args:
        directory: An empty scratch directory.
        rollouts: How many rollouts (each with ``calls`` captured calls, in order).
        calls: Calls per rollout.
        layout: The capture ledger's layout, ``sqlite`` or ``file``.
    """
    cpu = dict.fromkeys(STEPS, 0.0)
    wall_s = 0.0
    floor_cpu = 0.0
    floor_wall = 0.0
    floor = _FloorFiles(directory / "floor")
    line = b'{"model_call_id":"floor"}\n' * 20  # about one custody row's length
    hop = _ThreadHop()

    async def one_call(
        participant: ModelParticipant, key: str, messages: list[dict[str, str]], turn: int
    ) -> str:
        ledger = participant.ledger
        clock = time.process_time
        t0 = clock()
        ticket = await participant.admit(EpisodeId.from_capture_key(key))
        items = as_request_items(messages)  # as PolicyServer.serve does
        ticket.request_digest = conversation_digest(items)
        t1 = clock()
        admission = await resolve_admission(ledger, key, ticket.model_call_id, items)
        assert admission is not None, f"the parent of {ticket.model_call_id} did not resolve"
        t2 = clock()
        admission.model_dump(mode="json")
        pause = clock()
        body = _reply_json(admission, turn)  # the worker's work: not ours, not timed
        t2 += clock() - pause
        reply = CompletionReply.model_validate_json(body)
        t3 = clock()
        content = f"completion {turn} of {key}"
        commit = await record_custody(
            ledger,
            admission,
            reply.ng_commit_coords,
            request_items=items,
            response_items=[{"role": "assistant", "content": content}],
            response_id=f"resp_{ticket.model_call_id}",
            admitted_at=ticket.admitted_at,
        )
        assert commit is not None, "the worker's coordinates did not become a custody row"
        t4 = clock()
        await participant.gate.deliver(ticket)
        participant.release(ticket)
        t5 = clock()
        for step, spent in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            cpu[step] += spent
        return content

    async def main() -> None:
        nonlocal wall_s, floor_cpu, floor_wall
        ledger: FileCaptureLedger | SqliteCaptureLedger = (
            SqliteCaptureLedger(directory / "ledger", synchronous="OFF")
            if layout == "sqlite"
            else FileCaptureLedger(directory / "ledger")
        )
        participant = ModelParticipant(ledger)
        try:
            for index in range(rollouts):
                key = f"rollout-{index}"
                messages = [
                    {"role": "system", "content": "counter"},
                    {"role": "user", "content": f"{key} 0"},
                ]
                for turn in range(calls):
                    start = time.perf_counter()
                    content = await one_call(participant, key, messages, turn)
                    wall_s += time.perf_counter() - start
                    messages = [
                        *messages,
                        {"role": "assistant", "content": content},
                        {"role": "tool", "content": f"add {turn} -> {turn + 1} 0"},
                    ]
                    start, start_cpu = time.perf_counter(), time.process_time()
                    await hop.run(partial(floor.read, key))
                    await hop.run(partial(floor.append, key, line))
                    floor_cpu += time.process_time() - start_cpu
                    floor_wall += time.perf_counter() - start
        finally:
            ledger.close()

    gc.collect()
    with fsync_stubbed(), hop:
        anyio.run(main)
    total = sum(cpu.values())
    n = rollouts * calls
    return {
        "rollouts": rollouts,
        "calls_per_rollout": calls,
        "calls": n,
        "layout": layout,
        "fsync": "stubbed",
        "cpu_us_per_call": round(total / n * 1e6, 2),
        "wall_us_per_call": round(wall_s / n * 1e6, 2),
        "floor_cpu_us_per_call": round(floor_cpu / n * 1e6, 2),
        "floor_wall_us_per_call": round(floor_wall / n * 1e6, 2),
        "ratio": round(total / floor_cpu, 3) if floor_cpu > 0 else None,
        "steps": [
            {
                "step": step,
                "cpu_us_per_call": round(cpu[step] / n * 1e6, 2),
                "share": round(cpu[step] / total, 3) if total > 0 else None,
            }
            for step in STEPS
        ],
    }
