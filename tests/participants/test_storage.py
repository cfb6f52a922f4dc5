"""Writing and reading one participant's share: each rule fails its test when removed."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from participants import WRITE_STEPS, RecordsWriter, read_participant_checkpoint
from protocols import InvalidCheckpointStateError, serialize_manifest

KIND = "environment"
INSTANCE = "environment"


def _records(n: int, tag: str = "x") -> list[dict[str, Any]]:
    return [
        {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "tag": tag, "i": i} for i in range(n)
    ]


def _writer(directory: Path, checkpoint_id: str = "c1", **kwargs: Any) -> RecordsWriter:
    return RecordsWriter(
        directory, kind=KIND, instance=INSTANCE, checkpoint_id=checkpoint_id, **kwargs
    )


def _read(directory: Path, **kwargs: Any) -> Any:
    return read_participant_checkpoint(directory, kind=KIND, instance=INSTANCE, **kwargs)


def test_write_then_read_verifies_digest_and_count(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt" / "gym" / KIND / INSTANCE
    records = _records(50)
    manifest = _writer(directory).write(records, extra={"restored_pending": []})
    share = _read(directory)
    assert share.records == records
    assert share.manifest == manifest
    assert manifest["record_count"] == 50
    assert manifest["restored_pending"] == []
    on_disk = (directory / manifest["records_file"]).read_bytes()
    import hashlib

    assert hashlib.sha256(on_disk).hexdigest() == manifest["records_sha256"]
    assert (directory / "manifest.json").read_bytes() == serialize_manifest(manifest)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["manifest.json", manifest["records_file"]]
    )


@pytest.mark.parametrize("chunk_bytes", [1, 200, 1 << 20])
def test_records_written_in_chunks_are_whole_and_digested_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    import hashlib

    from participants._storage import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "RECORDS_CHUNK_BYTES", chunk_bytes)
    directory = tmp_path / "ckpt"
    records = _records(37)
    manifest = _writer(directory).write(records)
    on_disk = (directory / manifest["records_file"]).read_bytes()
    assert on_disk == b"".join(json.dumps(r).encode() + b"\n" for r in records)
    assert hashlib.sha256(on_disk).hexdigest() == manifest["records_sha256"]
    assert _read(directory).records == records


def test_key_order_is_preserved_through_a_round_trip(tmp_path: Path) -> None:
    record = {"zeta": 1, "alpha": {"y": 2, "b": 3}}
    _writer(tmp_path).write([record])
    (read,) = _read(tmp_path).records
    assert list(read) == ["zeta", "alpha"]
    assert list(read["alpha"]) == ["y", "b"]


def test_an_identical_repeat_returns_the_same_manifest(tmp_path: Path) -> None:
    first = _writer(tmp_path).write(_records(5))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    second = _writer(tmp_path).write(_records(5))
    assert second == first
    assert {p.name for p in tmp_path.iterdir()} == set(before)
    assert (tmp_path / "manifest.json").stat().st_mtime_ns == before["manifest.json"]


def test_a_different_commit_fails_and_leaves_the_first_intact(tmp_path: Path) -> None:
    first = _writer(tmp_path).write(_records(5))
    with pytest.raises(InvalidCheckpointStateError, match="already holds a different commit"):
        _writer(tmp_path).write(_records(6))
    assert _read(tmp_path).manifest == first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["manifest.json", first["records_file"]]
    )


def test_same_records_under_another_checkpoint_id_also_conflict(tmp_path: Path) -> None:
    first = _writer(tmp_path, "c1").write(_records(3))
    with pytest.raises(InvalidCheckpointStateError, match="different commit"):
        _writer(tmp_path, "c2").write(_records(3))
    assert _read(tmp_path).manifest == first
    assert (tmp_path / first["records_file"]).exists()


def test_a_stop_before_publication_means_no_manifest_ever(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    writer.stop()
    with pytest.raises(InvalidCheckpointStateError, match="stopped"):
        writer.write(_records(3))
    assert not (tmp_path / "manifest.json").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("step", WRITE_STEPS[:3])
def test_a_stop_at_any_point_before_publication_prevents_it(tmp_path: Path, step: str) -> None:
    writer: RecordsWriter

    def on_step(name: str) -> None:
        if name == step:
            writer.stop()

    writer = _writer(tmp_path, on_step=on_step)
    with pytest.raises(InvalidCheckpointStateError, match="stopped"):
        writer.write(_records(3))
    assert not (tmp_path / "manifest.json").exists()
    assert list(tmp_path.iterdir()) == [], "temp files are removed"


def test_stop_waits_for_a_publication_under_way(tmp_path: Path) -> None:
    stopper = threading.Thread(target=lambda: writer.stop())
    waited: list[bool] = []

    def on_step(name: str) -> None:
        if name == "records_renamed":  # inside the publication, under the stop lock
            stopper.start()
            stopper.join(timeout=0.2)
            waited.append(stopper.is_alive())

    writer = _writer(tmp_path, on_step=on_step)
    manifest = writer.write(_records(3))
    stopper.join(timeout=5)
    assert waited == [True], "stop must wait for a publication already under way"
    assert _read(tmp_path).manifest == manifest
    assert writer.stopped


def test_a_stop_while_streaming_stops_before_the_next_record(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    seen: list[int] = []

    def records() -> Any:
        for i in range(1000):
            seen.append(i)
            if i == 10:
                writer.stop()
            yield {"i": i}

    with pytest.raises(InvalidCheckpointStateError):
        writer.write(records())
    assert len(seen) == 11
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("bad", [math.nan, math.inf, {1, 2}, object()])
def test_unstorable_records_are_refused_and_nothing_is_published(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(InvalidCheckpointStateError, match="record 1"):
        _writer(tmp_path).write([{"ok": 1}, {"bad": bad}])
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_byte_fails_the_read(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(20))
    path = tmp_path / manifest["records_file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x20  # flips case of a letter: still valid JSON, different bytes
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointStateError, match="digest"):
        _read(tmp_path)


def test_a_wrong_count_fails_the_read(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(4))
    tampered = dict(manifest, record_count=5)
    (tmp_path / "manifest.json").write_bytes(serialize_manifest(tampered))
    with pytest.raises(InvalidCheckpointStateError, match="holds 4 records"):
        _read(tmp_path)


def test_a_truncated_records_file_fails_the_read(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(4))
    path = tmp_path / manifest["records_file"]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(InvalidCheckpointStateError):
        _read(tmp_path)


def test_a_line_that_is_not_an_object_fails_the_read(tmp_path: Path) -> None:
    import hashlib

    body = b'{"a": 1}\n[1]\n'
    digest = hashlib.sha256(body).hexdigest()
    (tmp_path / f"records-{digest}.jsonl").write_bytes(body)
    manifest = {
        "schema_version": 1,
        "kind": KIND,
        "instance": INSTANCE,
        "checkpoint_id": "c",
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": 2,
    }
    (tmp_path / "manifest.json").write_bytes(serialize_manifest(manifest))
    with pytest.raises(InvalidCheckpointStateError, match="line 2"):
        _read(tmp_path)


def test_a_missing_manifest_is_a_partial_commit(tmp_path: Path) -> None:
    (tmp_path / "records-x.jsonl").write_text("{}\n")
    with pytest.raises(InvalidCheckpointStateError, match="partial"):
        _read(tmp_path)


def test_a_missing_records_file_fails_the_read(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(2))
    (tmp_path / manifest["records_file"]).unlink()
    with pytest.raises(InvalidCheckpointStateError, match="missing"):
        _read(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema_version": 2}, "schema_version"),
        ({"kind": "agent"}, "belongs to agent/environment"),
        ({"instance": "other"}, "belongs to environment/other"),
        ({"checkpoint_id": 5}, "checkpoint_id"),
        ({"records_file": "../../etc/passwd"}, "unsafe records file"),
        ({"record_count": "2"}, "record_count"),
    ],
)
def test_a_foreign_or_malformed_manifest_fails_the_read(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    manifest = _writer(tmp_path).write(_records(2))
    (tmp_path / "manifest.json").write_text(json.dumps(manifest | change))
    with pytest.raises(InvalidCheckpointStateError, match=message):
        _read(tmp_path)


def test_manifest_that_is_not_json_fails_the_read(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(InvalidCheckpointStateError, match="not valid JSON"):
        _read(tmp_path)


def test_legacy_records_name_is_accepted(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(2))
    (tmp_path / manifest["records_file"]).rename(tmp_path / "records.jsonl")
    (tmp_path / "manifest.json").write_bytes(
        serialize_manifest(manifest | {"records_file": "records.jsonl"})
    )
    assert len(_read(tmp_path).records) == 2


def test_non_finite_numbers_are_accepted_on_read(tmp_path: Path) -> None:
    import hashlib

    body = b'{"x": NaN}\n{"x": Infinity}\n'
    digest = hashlib.sha256(body).hexdigest()
    (tmp_path / f"records-{digest}.jsonl").write_bytes(body)
    manifest = {
        "schema_version": 1,
        "kind": KIND,
        "instance": INSTANCE,
        "checkpoint_id": "c",
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": 2,
    }
    (tmp_path / "manifest.json").write_bytes(serialize_manifest(manifest))
    records = _read(tmp_path).records
    assert math.isnan(records[0]["x"]) and records[1]["x"] == math.inf


def test_select_filters_records_but_verification_covers_the_whole_file(tmp_path: Path) -> None:
    manifest = _writer(tmp_path).write(_records(10))
    share = _read(tmp_path, select=lambda r: r["i"] % 3 == 0)
    assert [r["i"] for r in share.records] == [0, 3, 6, 9]
    path = tmp_path / manifest["records_file"]
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"x"', b'"y"')  # corrupt a record the filter drops
    path.write_bytes(b"".join(lines))
    with pytest.raises(InvalidCheckpointStateError, match="digest"):
        _read(tmp_path, select=lambda r: r["i"] % 3 == 0)


def test_racing_writers_publish_exactly_one_manifest(tmp_path: Path) -> None:
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def run(n: int) -> None:
        barrier.wait()
        try:
            results.append(_writer(tmp_path).write(_records(3 + n % 2)))
        except InvalidCheckpointStateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = _read(tmp_path).manifest
    wins = [r for r in results if isinstance(r, dict)]
    assert wins and all(r == published for r in wins)
    losers = [r for r in results if isinstance(r, InvalidCheckpointStateError)]
    assert len(wins) + len(losers) == 8
    assert all("different commit" in n.detail for n in losers)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"manifest.json", published["records_file"]}
