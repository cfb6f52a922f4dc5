"""The capture-ledger benchmark: each operation beside its floor, measured in the same run.

A floor does the same system calls on the same file names as the ledger (open, write, fsync,
create, unlink, directory fsync) with everything else taken away: no locking, no JSON, no
models, no worker thread. The ratio says what the ledger's bookkeeping costs on top of the disk.

The SQLite layout (``--layout sqlite``, D340) keeps every ledger in one database file, so its
floor is one append-only log file: each write appends the same bytes and makes them durable with
one fsync per transaction the ledger commits (a row of ``record``; a group of the rollouts in
flight for ``record_concurrent``; a batch of retire, delete or import), and a manifest is one
``pread`` of the bytes a key's rows take in that log.

Sequential ``record`` and ``manifest`` also get a third figure: their floor's system calls, call
by call, sent through one bare event loop → thread → event loop round trip (``_ThreadHop``). The
ledger may not do blocking file work on the event loop, so that round trip is part of any
``record`` or ``manifest``; the difference to the floor (``hop_us_per_rollout``) shows how much of
the ratio it accounts for.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from participants import FileCaptureLedger, SqliteCaptureLedger
from protocols import CallRecord, CaptureLedgerCommit, custody_row, encode_row

from .ledger_floors import _Floor, _LogFloor, _plant, _ThreadHop, wake_probe

LAYOUTS = ("sqlite", "file")
OPERATIONS = (
    "record",
    "record_concurrent",
    "manifest",
    "manifest_concurrent",
    "retire",
    "delete",
    "import_rows_many",
)
IN_FLIGHT = 64
"""Rollouts recording at once in the ``record_concurrent`` row, reading at once in
``manifest_concurrent``."""
VIA_THREAD = ("record", "manifest")
"""Rows that also show their floor sent through one thread round trip per call (D189, D260)."""


def _hex(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _commit(key: str, turn: int) -> CaptureLedgerCommit:
    request: list[dict[str, Any]] = [
        {"role": "system", "content": "counter"},
        {"role": "user", "content": f"{key} 0"},
    ]
    for t in range(turn):
        request += [
            {"role": "assistant", "content": f"completion {t} of {key}"},
            {"role": "tool", "content": f"add {t} -> {t + 1} 0"},
        ]
    call = f"call-{turn}"
    record = CallRecord(
        model_call_id=call,
        parent_call_id=None if turn == 0 else f"call-{turn - 1}",
        staging_key=f"staging/{key}/{call}",
        weight_version=1,
        prev_len=32 * turn,
        delta_len=32,
        cum_len=32 * (turn + 1),
        digest=_hex("d", key, call),
        extras_digest=_hex("e"),
        mode="text" if turn == 0 else "token_in",
        admitted_at=time.time(),
        chain_hash=_hex("c", key, call),
        cumulative_hash=_hex("h", key, call),
        response_id=f"resp-{key}-{call}",
        fingerprint_version=1,
    )
    return CaptureLedgerCommit(
        rollout_id=key,
        record=record,
        staging_chain=tuple(f"staging/{key}/call-{t}" for t in range(turn + 1)),
        request_items=request,
        response_items=[{"role": "assistant", "content": f"completion {turn} of {key}"}],
    )


def run_ledger_bench(
    directory: Path, *, rollouts: int, calls: int = 4, batch: int = 256, layout: str = "sqlite"
) -> dict[str, Any]:
    """Measure every operation and its floor; µs per rollout and the ratio.

    Args:
        directory: An empty scratch directory on the disk to measure.
        rollouts: How many rollouts (each with ``calls`` rows).
        calls: Rows per rollout.
        batch: Ids per retire, delete and import batch.
        layout: The ledger's on-disk layout, ``sqlite`` or ``file`` (each with its own floor).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}")
    opened = SqliteCaptureLedger if layout == "sqlite" else FileCaptureLedger
    floor_of = _LogFloor if layout == "sqlite" else _Floor
    keys = [f"rollout-{i}" for i in range(rollouts)]
    commits = {key: [_commit(key, turn) for turn in range(calls)] for key in keys}
    lines = {key: [encode_row(custody_row(c)) for c in commits[key]] for key in keys}
    rows = {key: [custody_row(c) for c in commits[key]] for key in keys}
    whole = {key: b"".join(lines[key]) for key in keys}
    batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    ours_dir, floor_dir = directory / "ledger", directory / "floor"
    ledger = opened(ours_dir)
    floor = floor_of(floor_dir)
    # Ours and the floor alternate chunk by chunk, so both see the same disk weather.
    ours_s = dict.fromkeys(OPERATIONS, 0.0)
    floor_s = dict.fromkeys(OPERATIONS, 0.0)
    via_thread_s = dict.fromkeys(VIA_THREAD, 0.0)
    floor_via_thread = floor_of(directory / "floor-via-thread")
    hop = _ThreadHop()

    async def alternate(
        name: str,
        chunks: list[list[str]],
        ours: Callable[[list[str]], Any],
        bare: Callable[[list[str]], None],
        bare_via_thread: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> None:
        for chunk in chunks:
            start = time.perf_counter()
            await ours(chunk)
            ours_s[name] += time.perf_counter() - start
            start = time.perf_counter()
            bare(chunk)
            floor_s[name] += time.perf_counter() - start
            if bare_via_thread is not None:
                start = time.perf_counter()
                await bare_via_thread(chunk)
                via_thread_s[name] += time.perf_counter() - start

    async def record_chunk(
        chunk: list[str], into: FileCaptureLedger | SqliteCaptureLedger | None = None
    ) -> None:
        for key in chunk:
            for work in commits[key]:
                await (into or ledger).record(work)

    async def record_floor_via_thread(chunk: list[str]) -> None:
        # One round trip per row, as ``record`` makes one per call.
        for key in chunk:
            for index, line in enumerate(lines[key]):
                await hop.run(partial(floor_via_thread.record_row, key, line, first=index == 0))

    async def main() -> None:
        singles = [[key] for key in keys]  # per rollout: the finest alternation
        await alternate(
            "record",
            singles,
            record_chunk,
            lambda c: floor.record({k: lines[k] for k in c}),
            record_floor_via_thread,
        )

        async def record_many(chunk: list[str]) -> None:
            async with anyio.create_task_group() as group:
                for key in chunk:
                    group.start_soon(record_chunk, [key], busy)

        def floor_many(chunk: list[str]) -> None:
            if isinstance(floor_busy, _LogFloor):
                floor_busy.record_concurrent({k: lines[k] for k in chunk})
                return
            assert isinstance(busy, FileCaptureLedger)
            shards: dict[int, list[str]] = {}
            for key in chunk:
                shards.setdefault(busy.commit_shard(key), []).append(key)
            floor_busy.record_concurrent(pool, shards, {k: lines[k] for k in chunk})

        # The same rollouts again in fresh directories, IN_FLIGHT of them recording at once.
        busy = opened(directory / "ledger-concurrent")
        floor_busy = floor_of(directory / "floor-concurrent")
        waves = [keys[i : i + IN_FLIGHT] for i in range(0, len(keys), IN_FLIGHT)]
        try:
            with ThreadPoolExecutor(busy.commit_threads) as pool:
                await alternate("record_concurrent", waves, record_many, floor_many)
        finally:
            busy.close()
            floor_busy.close()
        cold = opened(ours_dir)  # a fresh process's view: nothing cached

        async def manifest_chunk(chunk: list[str]) -> None:
            for key in chunk:
                await cold.manifest(key)

        async def manifest_floor_via_thread(chunk: list[str]) -> None:
            # The floor-via-thread directory holds the same ledgers: its record floor wrote them.
            await hop.run(partial(floor_via_thread.manifest, chunk))

        try:
            await alternate(
                "manifest", singles, manifest_chunk, floor.manifest, manifest_floor_via_thread
            )
        finally:
            cold.close()
        cold_many = opened(ours_dir)  # again nothing cached, IN_FLIGHT manifests at once

        async def manifest_many(chunk: list[str]) -> None:
            async with anyio.create_task_group() as group:
                for key in chunk:
                    group.start_soon(cold_many.manifest, key)

        try:
            await alternate("manifest_concurrent", waves, manifest_many, floor.manifest)
        finally:
            cold_many.close()
        await alternate("retire", batches, ledger.retire, lambda c: floor.retire([c]))
        if isinstance(ledger, SqliteCaptureLedger):  # untimed: live ledgers to delete
            ledger.import_rows_many(rows)
        else:
            _plant(ours_dir, whole)
            _plant(floor_dir, whole)
        await alternate("delete", batches, ledger.delete, lambda c: floor.delete([c]))

        async def import_chunk(chunk: list[str]) -> None:
            ledger.import_rows_many({key: rows[key] for key in chunk})

        await alternate(
            "import_rows_many",
            batches,
            import_chunk,
            lambda c: floor.import_rows_many([{k: whole[k] for k in c}]),
        )

    try:
        with hop:
            anyio.run(main)
    finally:
        ledger.close()
        floor.close()
        floor_via_thread.close()
    operations: list[dict[str, Any]] = []
    for name in OPERATIONS:
        ours, bare = ours_s[name], floor_s[name]
        operations.append(
            {
                "operation": name,
                "us_per_rollout": round(ours / rollouts * 1e6, 2),
                "floor_us_per_rollout": round(bare / rollouts * 1e6, 2),
                "ratio": round(ours / bare, 3) if bare > 0 else None,
            }
        )
        if name in VIA_THREAD:
            # Beside the ratio, never instead of it: the floor stays the bare system calls.
            via = via_thread_s[name]
            operations[-1] |= {
                "floor_via_thread_us_per_rollout": round(via / rollouts * 1e6, 2),
                "hop_us_per_rollout": round((via - bare) / rollouts * 1e6, 2),
                "ratio_to_floor_via_thread": round(ours / via, 3) if via > 0 else None,
            }
    return {
        "rollouts": rollouts,
        "layout": layout,
        "calls_per_rollout": calls,
        "batch": batch,
        "operations": operations,
        # After the timed rows, so its pinned threads disturb none of them (D444).
        "wake_probe_us": wake_probe(),
    }
