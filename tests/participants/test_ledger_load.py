"""Many rollouts in flight at once, retired in batches: nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from participants import FileCaptureLedger
from participants._ledger.locks import DEFAULT_STRIPES, LOCK_DIRECTORY

from .ledger_factory import commit

pytestmark = pytest.mark.anyio


async def run_load(root: Path, *, rollouts: int, calls: int, in_flight: int, batch: int) -> None:
    ledger = FileCaptureLedger(root)
    limiter = anyio.Semaphore(in_flight)
    finished: list[str] = []
    retired: list[str] = []

    async def rollout(index: int) -> None:
        key = f"r{index}"
        async with limiter:
            for turn in range(calls):
                await ledger.record(commit(key, turn))
        finished.append(key)
        if len(finished) >= batch:
            chunk = finished[:batch]
            del finished[:batch]
            await ledger.retire(chunk)
            retired.extend(chunk)

    try:
        async with anyio.create_task_group() as group:
            for index in range(rollouts):
                group.start_soon(rollout, index)
        if finished:
            await ledger.retire(finished)
            retired.extend(finished)
        assert sorted(retired) == sorted(f"r{i}" for i in range(rollouts))
        assert ledger.cache_sizes() == {"ledger_rollouts": 0, "ledger_rows": 0}
    finally:
        ledger.close()
    check_nothing_left(root, rollouts)


def check_nothing_left(root: Path, rollouts: int) -> None:
    ledger_bytes = sum(p.stat().st_size for p in root.glob("*.lineage.jsonl"))
    assert ledger_bytes == 0 and not list(root.glob("*.lineage.jsonl"))
    assert len(list(root.glob("*.lineage.retired"))) == rollouts  # fences only
    locks = list((root / LOCK_DIRECTORY).iterdir())
    assert len(locks) == DEFAULT_STRIPES  # no lock file beyond the fixed stripes


async def test_load_small(tmp_path: Path) -> None:
    await run_load(tmp_path, rollouts=400, calls=4, in_flight=64, batch=32)


@pytest.mark.soak
async def test_load_20000_rollouts_1024_in_flight(tmp_path: Path) -> None:
    await run_load(tmp_path, rollouts=20_000, calls=4, in_flight=1024, batch=256)
