"""The capture ledger's state machine and operations (§2.6 to §2.7), against both ledgers."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

import participants._ledger.common as common
from participants import FileCaptureLedger, MemoryCaptureLedger, SqliteCaptureLedger
from participants._ledger.common import CAPTURE_FILE_SUFFIXES, doomed_keys, split_attempt
from participants._ledger.staging import copy_entry
from protocols import (
    CaptureLedger,
    InvalidRolloutIdError,
    RolloutRemoval,
    RolloutRetiredError,
)

from .ledger_factory import commit, conversation

pytestmark = pytest.mark.anyio

Ledger = FileCaptureLedger | MemoryCaptureLedger | SqliteCaptureLedger


@pytest.fixture(params=["file", "memory", "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    made: Ledger
    if request.param == "file":
        made = FileCaptureLedger(tmp_path / "ledger")
    elif request.param == "sqlite":
        made = SqliteCaptureLedger(tmp_path / "ledger")
    else:
        made = MemoryCaptureLedger()
    yield made
    made.close()


def plant_fence(ledger: Ledger, key: str) -> None:
    """A fence appearing beside a live ledger: what retire's first phase leaves for a moment."""
    if isinstance(ledger, FileCaptureLedger):
        (ledger.root / f"{key}.lineage.retired").touch()
    elif isinstance(ledger, SqliteCaptureLedger):
        with sqlite3.connect(ledger.path) as conn:
            conn.execute(
                "INSERT INTO marks (key, rollout, attempt, fenced, started) VALUES (?, ?, 0, 1, 0)",
                (key, key),
            )
    else:
        ledger._fences.add(key)


async def test_both_ledgers_satisfy_the_protocol(ledger: Ledger) -> None:
    assert isinstance(ledger, CaptureLedger)


async def test_absent_reads_empty_then_first_record_makes_it_live(ledger: Ledger) -> None:
    assert (await ledger.manifest("r")).records == []
    assert not await ledger.has_rows("r")
    await ledger.record(commit("r", 0))
    await ledger.record(commit("r", 1))
    manifest = await ledger.manifest("r")
    assert [r.model_call_id for r in manifest.records] == ["call-0", "call-1"]
    assert manifest.records[1].parent_call_id == "call-0"
    assert await ledger.has_rows("r")


async def test_identical_repeat_is_a_noop_and_a_difference_conflicts(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    await ledger.record(commit("r", 0))
    assert len(ledger.export_rows("r")) == 1
    with pytest.raises(ValueError, match="conflicting"):
        await ledger.record(commit("r", 0, response_id="another-response"))
    assert len(ledger.export_rows("r")) == 1


async def test_failure_rows_dedupe_and_a_new_reason_appends(ledger: Ledger) -> None:
    await ledger.record_failure("r", "c1", "worker_capture_failed")
    await ledger.record_failure("r", "c1", "worker_capture_failed")
    await ledger.record_failure("r", "c1", "unresolved_parent")
    manifest = await ledger.manifest("r")
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
        ("c1", "worker_capture_failed"),
        ("c1", "unresolved_parent"),
    ]


async def test_retire_live_then_reads_as_retired_and_late_rows_are_discarded(
    ledger: Ledger,
) -> None:
    await ledger.record(commit("r", 0))
    assert await ledger.retire(["r", "r"]) == RolloutRemoval(removed=["r"], absent=[])
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("r")
    with pytest.raises(RolloutRetiredError):
        await ledger.has_rows("r")
    with capture_logs() as logs:
        await ledger.record(commit("r", 1))
        await ledger.record_failure("r", "c9", "worker_capture_failed")
    assert ledger.export_rows("r") == []
    late = [e for e in logs if e["event"] == "ledger_late_write_discarded"]
    assert [e["staging_key"] for e in late] == ["stage/r/call-1", ""]


async def test_retire_absent_fences_an_unused_id(ledger: Ledger) -> None:
    assert await ledger.retire(["never"]) == RolloutRemoval(removed=[], absent=["never"])
    await ledger.record(commit("never", 0))
    assert ledger.export_rows("never") == []
    with pytest.raises(RolloutRetiredError):
        await ledger.manifest("never")


async def test_retire_again_is_a_noop_reported_absent(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    await ledger.retire(["r"])
    assert await ledger.retire(["r"]) == RolloutRemoval(removed=[], absent=["r"])


async def test_delete_of_retired_removes_the_fence_so_the_id_is_reusable(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    await ledger.retire(["r"])
    assert await ledger.delete(["r"]) == RolloutRemoval(removed=[], absent=["r"])
    assert (await ledger.manifest("r")).records == []
    await ledger.record(commit("r", 0))
    assert len((await ledger.manifest("r")).records) == 1


async def test_delete_of_live_and_absent(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    assert await ledger.delete(["r", "x"]) == RolloutRemoval(removed=["r"], absent=["x"])
    assert (await ledger.manifest("r")).records == []
    assert ledger.export_rows("r") == []


async def test_the_fence_is_only_consulted_when_the_ledger_has_no_rows(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    plant_fence(ledger, "r")  # retire is between its phases: the ledger still exists
    await ledger.record(commit("r", 1))
    assert [row["model_call_id"] for row in ledger.export_rows("r")] == ["call-0", "call-1"]


@pytest.mark.parametrize("operation", ["retire", "delete", "delete_unstarted"])
async def test_batches_are_validated_whole_before_any_change(
    ledger: Ledger, operation: str
) -> None:
    await ledger.record(commit("r", 0))
    method = getattr(ledger, operation)
    with pytest.raises(TypeError, match="sequence of rollout ids"):
        await method("r")
    for bad in (["r", "bad/id"], ["r", ""], ["r", ".."], ["r", ".hidden"], ["r", 7]):
        with pytest.raises(InvalidRolloutIdError):
            await method(bad)
    assert len(ledger.export_rows("r")) == 1
    assert (await ledger.manifest("r")).records


async def test_start_marker_protects_from_delete_unstarted(ledger: Ledger) -> None:
    for key in ("a-a1", "b-a1"):
        await ledger.record(commit(key, 0))
    assert await ledger.mark_started("a-a1")
    result = await ledger.delete_unstarted(["a-a1", "b-a1", "c-a1"])
    assert result == RolloutRemoval(removed=["b-a1"], absent=["c-a1"])  # started: in neither
    assert len(ledger.export_rows("a-a1")) == 1
    assert await ledger.delete(["a-a1"]) == RolloutRemoval(removed=["a-a1"], absent=[])
    # delete removed the marker too: the key is unstarted again
    await ledger.record(commit("a-a1", 0))
    assert (await ledger.delete_unstarted(["a-a1"])).removed == ["a-a1"]


async def test_a_retired_id_is_never_marked_started(ledger: Ledger) -> None:
    await ledger.retire(["r-a1"])
    assert not await ledger.mark_started("r-a1")
    await ledger.delete(["r-a1"])
    await ledger.record(commit("r-a1", 0))
    assert (await ledger.delete_unstarted(["r-a1"])).removed == ["r-a1"]


async def test_mark_started_and_delete_unstarted_race_cleanly(ledger: Ledger) -> None:
    keys = [f"k{i}-a1" for i in range(60)]
    for key in keys:
        await ledger.record(commit(key, 0))
    marked: dict[str, bool] = {}
    result: list[RolloutRemoval] = []

    async def mark(key: str) -> None:
        marked[key] = await ledger.mark_started(key)

    async def drop() -> None:
        result.append(await ledger.delete_unstarted(keys))

    async with anyio.create_task_group() as group:
        group.start_soon(drop)
        for key in keys:
            group.start_soon(mark, key)
    removed = set(result[0].removed)
    for key in keys:
        # Either the marker won (ledger kept, key in neither list) or the removal did.
        assert (key in removed) != bool(ledger.export_rows(key))
        assert key not in result[0].absent


async def test_import_wipes_target_and_later_attempts_but_not_lookalikes(ledger: Ledger) -> None:
    for key in ("r-a1", "r-a2", "r-a3", "r1-a2", "r-a1x-a3", "r", "s-a2"):
        await ledger.record(commit(key, 0, output=f"dead {key}"))
    await ledger.retire(["r-a3"])
    await ledger.mark_started("r-a2")
    rows = [dict(row, capture_key="r") for row in ledger.export_rows("r")]
    ledger.import_rows_many({"r-a1": rows, "s-a2": []})
    assert ledger.export_rows("r-a1") == rows  # written whole, the dead execution's row gone
    for gone in ("r-a2", "r-a3", "s-a2"):
        assert ledger.export_rows(gone) == []
    assert (await ledger.manifest("r-a3")).records == []  # the fence went too
    assert (await ledger.delete_unstarted(["r-a2"])).absent == ["r-a2"]  # and the marker
    for kept in ("r1-a2", "r-a1x-a3", "r"):
        assert len(ledger.export_rows(kept)) == 1
    manifest = await ledger.manifest("r-a1")
    assert manifest.rollout_id == "r-a1"
    assert "capture_key" not in manifest.model_dump(mode="json")["records"][0]  # D222


async def test_import_validates_everything_before_changing_anything(ledger: Ledger) -> None:
    await ledger.record(commit("r-a1", 0))
    with pytest.raises(InvalidRolloutIdError):
        ledger.import_rows_many({"r-a1": [], "../x": []})
    with pytest.raises(ValueError):
        ledger.import_rows_many({"r-a1": [{"model_call_id": "c", "bogus": 1}]})
    with pytest.raises(TypeError):
        ledger.import_rows_many("r-a1")  # type: ignore[arg-type]
    assert len(ledger.export_rows("r-a1")) == 1


async def test_resolve_finds_the_parent_and_retired_never_matches(ledger: Ledger) -> None:
    await ledger.record(commit("r", 0))
    await ledger.record_failure("r", "call-x", "worker_capture_failed")
    assert (await ledger.resolve("r", conversation(0))).status == "root"
    resolution = await ledger.resolve("r", conversation(1))
    assert resolution.status == "resolved" and resolution.match is not None
    assert resolution.match.model_call_id == "call-0" and resolution.match.prev_len == 5
    assert resolution.match.staging_chain == ("stage/r/call-0",)
    explicit = await ledger.resolve_explicit("r", "call-0", conversation(1))
    assert explicit.status == "resolved"
    missing = await ledger.resolve_explicit("r", "call-x", conversation(1))
    assert missing.reason == "explicit_parent_missing"  # failure rows never resolve
    await ledger.retire(["r"])
    retired = await ledger.resolve("r", conversation(1))
    assert retired.status == "unresolved" and retired.match is None


async def test_concurrent_records_of_one_rollout_all_land_once(ledger: Ledger) -> None:
    async with anyio.create_task_group() as group:
        for turn in range(40):
            group.start_soon(ledger.record, commit("r", turn))
            group.start_soon(ledger.record, commit("r", turn))
    rows: list[dict[str, Any]] = ledger.export_rows("r")
    assert sorted(row["model_call_id"] for row in rows) == sorted(f"call-{t}" for t in range(40))


async def test_retire_and_delete_leave_no_cached_rows(ledger: Ledger) -> None:
    for i in range(10):
        await ledger.record(commit(f"k{i}", 0))
    await ledger.manifest("k0")
    await ledger.retire([f"k{i}" for i in range(5)])
    await ledger.delete([f"k{i}" for i in range(5, 10)])
    assert ledger.cache_sizes() == {"ledger_rollouts": 0, "ledger_rows": 0}


@pytest.mark.parametrize("layout", [FileCaptureLedger, SqliteCaptureLedger])
async def test_rows_cached_by_a_reader_after_a_retire_never_let_a_late_row_in(
    layout: type[FileCaptureLedger | SqliteCaptureLedger], tmp_path: Path
) -> None:
    # A reader refreshes a key under the key's lock, but a retire drops the cached rows without
    # it: a read that began before the retire can store the rows it read after the drop. Every
    # write reads the key's rows from the store again (D355), so the stale entry is noticed even
    # when nothing else has written since this process's last commit.
    ledger = layout(tmp_path / "ledger")
    try:
        await ledger.record(commit("r", 0))
        await ledger.record(commit("r", 1))
        cached = ledger._cache.get("r")
        assert cached is not None
        stale = copy_entry(cached)
        await ledger.retire(["r"])
        ledger._cache.store("r", stale)  # the reader's store lands after the retire's drop
        await ledger.record(commit("other", 0))  # this process commits once more in between
        with capture_logs() as logs:
            await ledger.record(commit("r", 2))
        assert ledger.export_rows("r") == []
        assert [e["event"] for e in logs] == ["ledger_late_write_discarded"]
        with pytest.raises(RolloutRetiredError):
            await ledger.manifest("r")
    finally:
        ledger.close()


_SUFFIXES = st.sampled_from((*CAPTURE_FILE_SUFFIXES, ".other", ".lineage.jsonl.tmp", ""))
_KEY_PART = st.one_of(
    st.tuples(
        st.sampled_from(["r", "r1", "r-a1x", "s", "r-a0", "a.b"]),
        st.sampled_from(["", "-a1", "-a2", "-a3", "-a10", "-a01", "-a2-a3"]),
    ).map("".join),
    st.text(alphabet="ra1-0x.", min_size=1, max_size=8),
)


@given(
    names=st.lists(st.tuples(_KEY_PART, _SUFFIXES).map("".join), max_size=30),
    targets=st.lists(_KEY_PART, min_size=1, max_size=4),
)
def test_doomed_keys_reads_every_name_as_split_attempt_and_the_suffixes_do(
    names: list[str], targets: list[str]
) -> None:
    # D258: the one regular expression must agree with the plain reading it replaced.
    expected: dict[str, list[str]] = {}
    floors: dict[str, int] = {}
    for target in targets:
        rollout, attempt = split_attempt(target)
        floors[rollout] = min(attempt, floors.get(rollout, attempt))
    for name in names:
        suffix = next(
            (s for s in CAPTURE_FILE_SUFFIXES if name.endswith(s) and len(name) > len(s)), None
        )
        if suffix is None:
            continue
        key = name[: -len(suffix)]
        rollout, attempt = split_attempt(key)
        if rollout in floors and attempt >= floors[rollout]:
            expected.setdefault(key, []).append(suffix)
    assert doomed_keys(names, targets) == expected


def test_doomed_keys_splits_no_target_where_no_name_is_a_capture_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D434: a SQLite ledger's directory holds only its database; a restore's 16,000 targets
    # were each split for nothing.
    def refuse(key: str) -> tuple[str, int]:
        raise AssertionError(f"{key} was split")

    monkeypatch.setattr(common, "split_attempt", refuse)
    names = ["ledger.sqlite3", "ledger.sqlite3-wal", "ledger.sqlite3-shm"]
    assert doomed_keys(names, [f"r{i}-a1" for i in range(100)]) == {}
    with pytest.raises(AssertionError, match="was split"):
        doomed_keys([*names, "r7.lineage.jsonl"], ["r7"])


async def test_export_rows_many_reads_each_id_as_export_rows_does_in_the_order_given(
    ledger: Ledger,
) -> None:
    for key, turns in (("b", 3), ("a", 1), ("a-a1", 2), ("gone", 1)):
        for turn in range(turns):
            await ledger.record(commit(key, turn, rollout=key.split("-")[0]))
    await ledger.record_failure("a", "call-9", "engine_error")
    await ledger.retire(["gone"])
    order = ["b", "never", "a-a1", "gone", "a", "b"]
    many = ledger.export_rows_many(order)
    assert many == [ledger.export_rows(key) for key in order]
    assert [len(rows) for rows in many] == [3, 0, 2, 0, 2, 3]
    assert [row["model_call_id"] for row in many[0]] == ["call-0", "call-1", "call-2"]
    many[0][0]["model_call_id"] = "changed"  # a copy: the ledger's rows stay as they were
    assert ledger.export_rows("b")[0]["model_call_id"] == "call-0"
    with pytest.raises(InvalidRolloutIdError):
        ledger.export_rows_many(["a", "../escape"])


def test_split_attempt_splits_exactly_what_the_regular_expression_splits() -> None:
    # D441: the split without a regular expression, over all 137,257 keys of up to six characters
    # drawn from the characters that matter (the separator's, digits with a zero, a newline,
    # a non-ASCII digit).
    import itertools

    from participants._ledger.common import _ATTEMPT

    def by_pattern(key: str) -> tuple[str, int]:
        match = _ATTEMPT.fullmatch(key)
        return (key, 0) if match is None else (match.group(1), int(match.group(2)))

    checked = 0
    for length in range(7):
        for letters in itertools.product("-a01x\n\u0663", repeat=length):
            key = "".join(letters)
            assert split_attempt(key) == by_pattern(key), key
            checked += 1
    assert checked == sum(7**n for n in range(7))


def test_a_row_cache_drops_many_keys_at_once() -> None:
    from participants._ledger.cache import CachedLedger, RowCache

    cache = RowCache()
    for key, rows in (("a", 2), ("b", 3), ("c", 1)):
        cache.store(key, CachedLedger(0, 0, rows=[{"n": n} for n in range(rows)]))
    cache.pop_many(iter(["a", "c", "missing", "a"]))
    assert "a" not in cache and "c" not in cache and "b" in cache
    assert cache.sizes() == {"ledger_rollouts": 1, "ledger_rows": 3}
