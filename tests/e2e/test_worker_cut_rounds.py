"""A worker's cut rounds over calls with long contexts: batches bounded by tokens (D421), the
staged prefix encoded once (D420), the collector paused for the round (D422), and the suite
that measures them (``midflight bench cuts``, D419)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import e2e._worker.engine as engine_module
import protocols._hashes as hashes_module
import protocols._staged_prefix as staged_prefix_module
from e2e._bench.cuts import _inventory, _live_calls, run_cuts_bench
from e2e._servers.evidence import EvidenceLog
from e2e._worker.cuts import cut_batches, new_tokens
from e2e._worker.engine import WorkerEngine
from participants import FileTokenStagingStore, rebuild_generation_cut
from protocols import GenerationCutReceipt, StagedEntry, compute_chain_hash, hash_token_ids

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class WatchedStore(FileTokenStagingStore):
    """A staging store that notes, for each batch, its size and whether the collector ran."""

    def __init__(self, root: Path, *, delay_s: float = 0.0) -> None:
        super().__init__(root)
        self.batches: list[int] = []
        self.collector_on: list[bool] = []
        self.delay_s = delay_s

    def put_many(self, entries: Sequence[StagedEntry]) -> None:
        self.collector_on.append(gc.isenabled())
        time.sleep(self.delay_s)
        super().put_many(entries)
        self.batches.append(len(entries))


def _engine(tmp_path: Path, store: FileTokenStagingStore, **options: float) -> WorkerEngine:
    return WorkerEngine(store=store, evidence=EvidenceLog(tmp_path / "evidence.jsonl"), **options)


async def _round(engine: WorkerEngine, checkpoint_id: str) -> GenerationCutReceipt:
    return await engine.cut(_inventory(engine, checkpoint_id))


async def test_a_round_splits_its_calls_by_the_tokens_their_records_carry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "CUT_BATCH_TOKENS", 350)
    store = WatchedStore(tmp_path / "staging")
    engine = _engine(tmp_path, store)
    _live_calls(engine, 5, prompt_tokens=100, generated=50)  # 150 new tokens a call
    receipt = await _round(engine, "ck-1")
    assert [ack.disposition for ack in receipt.prefixes] == ["durable_prefix"] * 5
    assert store.batches == [2, 2, 1]  # 300 tokens, 300, 150
    for live in engine.live.values():
        live.append(1, -1.0)
    await _round(engine, "ck-2")  # a chunk of one token each: one batch
    assert store.batches[3:] == [5]


def test_a_call_heavier_than_the_limit_is_a_batch_of_its_own(tmp_path: Path) -> None:
    engine = _engine(tmp_path, FileTokenStagingStore(tmp_path / "staging"))
    _live_calls(engine, 3, prompt_tokens=10, generated=5)
    running = [(None, live) for live in engine.live.values()]
    assert [new_tokens(live) for _, live in running] == [15, 15, 15]
    sizes = [len(batch) for batch in cut_batches(running, calls=10, tokens=10)]  # type: ignore[arg-type]
    assert sizes == [1, 1, 1]
    sizes = [len(batch) for batch in cut_batches(running, calls=2, tokens=1000)]  # type: ignore[arg-type]
    assert sizes == [2, 1]


async def test_a_round_past_its_deadline_keeps_the_token_batches_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "CUT_BATCH_TOKENS", 150)
    store = WatchedStore(tmp_path / "staging", delay_s=0.2)
    engine = _engine(tmp_path, store, cut_timeout_ms=500.0)
    _live_calls(engine, 4, prompt_tokens=100, generated=50)
    receipt = await _round(engine, "ck-1")
    durable = [ack.disposition == "durable_prefix" for ack in receipt.prefixes]
    assert 1 <= sum(durable) <= 3 and durable == sorted(durable, reverse=True)
    assert all(
        len(live.staged) == int(made)
        for live, made in zip(engine.live.values(), durable, strict=True)
    )


async def test_the_collector_is_off_while_a_round_stages_and_on_after(tmp_path: Path) -> None:
    assert gc.isenabled()
    store = WatchedStore(tmp_path / "staging")
    engine = _engine(tmp_path, store)
    _live_calls(engine, 3, prompt_tokens=20, generated=4)
    await _round(engine, "ck-1")
    assert store.collector_on == [False]
    assert gc.isenabled()


async def test_every_round_encodes_each_new_token_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D420, D423: a round encodes the tokens it stages once, for their hashes, their record's
    digest and every later digest of the prefix; masks and log-probs are never encoded again."""
    encoded: list[int] = []
    floats: list[int] = []
    lock = threading.Lock()

    def counting(into: list[int], real: Callable[..., bytes]) -> Callable[..., bytes]:
        def count(values: Sequence[Any], **kwargs: Any) -> bytes:
            with lock:
                into.append(len(values))
            return real(values, **kwargs)

        return count

    for module, name, into in (
        (staged_prefix_module, "encode_token_elements", encoded),
        (hashes_module, "encode_token_ids", encoded),  # the builders' hashes
        (hashes_module, "encode_token_elements", encoded),  # a record's digest
        (staged_prefix_module, "encode_float32_elements", floats),
    ):
        monkeypatch.setattr(module, name, counting(into, getattr(module, name)))
    store = FileTokenStagingStore(tmp_path / "staging")
    engine = _engine(tmp_path, store)
    _live_calls(engine, 2, prompt_tokens=300, generated=40)
    await _round(engine, "ck-1")  # each call's cumulative record
    assert sorted(encoded) == [340, 340]
    for round_number, chunk in ((2, 7), (3, 5)):
        encoded.clear()
        for live in engine.live.values():
            for token in range(chunk):
                live.append(token, -1.0)
        receipt = await _round(engine, f"ck-{round_number}")
        assert sorted(encoded) == [chunk, chunk]
        for ack, live in zip(receipt.prefixes, engine.live.values(), strict=True):
            entries = [store.get(key) for key in ack.staging_keys or []]
            records = [entry.record for entry in entries if entry is not None]
            assert ack.prefix_digest == rebuild_generation_cut(records).digest
            assert ack.prefix_token_count == len(live.generated)
    assert floats == []


def test_the_cuts_bench_reports_every_round_beside_its_floor(tmp_path: Path) -> None:
    payload = run_cuts_bench(
        tmp_path, calls=[3, 5], prompt_tokens=400, generated=8, chunk=4, rounds=2
    )
    rows = payload["rows"]
    assert [(row["calls"], row["round"], row["staged"]) for row in rows] == [
        (3, 1, "cumulative"),
        (3, 2, "chunk"),
        (5, 1, "cumulative"),
        (5, 2, "chunk"),
    ]
    for row in rows:
        assert row["cut"] == row["calls"] and row["cut_failed"] == 0
        per_call = 400 + 8 + 4 * (row["round"] - 1)
        assert row["tokens_per_call"] == per_call
        assert row["tokens_in_flight"] == row["calls"] * per_call
        assert row["bytes_written"] > 0 and row["floor_s"] > 0 and row["ratio"] > 0
    # A cumulative record carries every token, a chunk only the new ones.
    assert rows[0]["bytes_written"] > 4 * rows[1]["bytes_written"]
    with pytest.raises(ValueError, match="positive"):
        run_cuts_bench(tmp_path, calls=[], rounds=1)


async def test_later_turns_are_cut_on_their_parent(tmp_path: Path) -> None:
    """``bench cuts --parent-tokens``: each call continues a parent sequence; its cut records
    carry only its own tokens, and their hashes chain from the parent as a completion's do."""
    store = FileTokenStagingStore(tmp_path / "staging")
    engine = _engine(tmp_path, store)
    _live_calls(engine, 3, prompt_tokens=20, generated=6, parent_tokens=50)
    for round_number in (1, 2):
        if round_number == 2:
            for live in engine.live.values():
                live.append(5, -1.0)
        receipt = await _round(engine, f"ck-{round_number}")
        for ack, live in zip(receipt.prefixes, engine.live.values(), strict=True):
            records = [store.get(key).record for key in ack.staging_keys or []]  # type: ignore[union-attr]
            parent, own = live.engine_prompt[:50], live.engine_prompt[50:] + live.generated
            assert [r.prev_len for r in records] == [50] * round_number
            assert sum(r.delta_len for r in records) == len(own) == 26 + round_number - 1
            assert (records[-1].chain_hash, records[-1].cumulative_hash) == (
                compute_chain_hash(compute_chain_hash(None, parent), own),
                hash_token_ids(parent + own),
            )
            assert ack.prefix_digest == rebuild_generation_cut(records).digest


def test_the_cuts_bench_counts_the_parent_s_tokens_in_flight(tmp_path: Path) -> None:
    payload = run_cuts_bench(tmp_path, calls=[2], prompt_tokens=10, parent_tokens=30, rounds=1)
    assert payload["parent_tokens"] == 30
    assert payload["rows"][0]["tokens_per_call"] == 30 + 10 + 512
    assert payload["rows"][0]["cut"] == 2
