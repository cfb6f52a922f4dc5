"""One participant's share on either checkpoint store: a directory, or a real S3 API (moto's).

The writer and the reader reach the share only through ``open_store``, so every rule here must
hold the same on both stores; the directory-only rules (temp names, fsyncs) are in
``test_storage.py`` and ``test_storage_crash.py``.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from participants import WRITE_STEPS, RecordsWriter, read_participant_checkpoint
from participants._storage.checkpoint_store import ShareLocation
from protocols import (
    CheckpointStore,
    InvalidCheckpointStateError,
    is_object_store_url,
    open_store,
    serialize_manifest,
)

KIND = "model"
INSTANCE = "policy"


class _Crash(Exception):
    """What a test raises at a write step: the writer dies there, as if killed."""


@pytest.fixture(params=["posix", "s3"])
def share(request: pytest.FixtureRequest, tmp_path: Path) -> ShareLocation:
    """The location of one participant's share, on the store the parameter names."""
    if request.param == "posix":
        return tmp_path / "ckpt" / "gym" / KIND / INSTANCE
    root: str = request.getfixturevalue("s3_root")
    return f"{root}/ckpt/gym/{KIND}/{INSTANCE}"


@pytest.fixture
def spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The local temporary directory, watched: an S3 write spools its records there."""
    directory = tmp_path / "spool"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def _records(n: int, tag: str = "x") -> list[dict[str, Any]]:
    return [
        {"episode_id": {"rollout_id": f"r{i}", "attempt": 0}, "tag": tag, "i": i} for i in range(n)
    ]


def _writer(location: ShareLocation, checkpoint_id: str = "c1", **kwargs: Any) -> RecordsWriter:
    return RecordsWriter(
        location, kind=KIND, instance=INSTANCE, checkpoint_id=checkpoint_id, **kwargs
    )


def _read(location: ShareLocation) -> Any:
    return read_participant_checkpoint(location, kind=KIND, instance=INSTANCE)


def _names(store: CheckpointStore) -> list[str]:
    """Every object of the share; on a directory, temp (dot) files too."""
    root = Path(store.url)
    if not is_object_store_url(store.url):
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return [o.key for o in store.list_objects("")]


def test_a_share_round_trips_with_the_manifest_naming_its_records(share: ShareLocation) -> None:
    records = _records(40)
    manifest = _writer(share).write(records, extra={"restored_pending": []})
    result = _read(share)
    assert result.records == records and result.manifest == manifest
    store = open_store(share)
    body = store.read(manifest["records_file"])
    assert hashlib.sha256(body).hexdigest() == manifest["records_sha256"]
    assert result.bytes_read == len(body)
    assert store.read("manifest.json") == serialize_manifest(manifest)
    assert _names(store) == sorted(["manifest.json", manifest["records_file"]])


def test_an_identical_repeat_returns_the_same_manifest(share: ShareLocation) -> None:
    first = _writer(share).write(_records(5))
    store = open_store(share)
    before = store.read("manifest.json")
    assert _writer(share).write(_records(5)) == first
    assert store.read("manifest.json") == before
    assert _names(store) == sorted(["manifest.json", first["records_file"]])


def test_a_different_commit_is_refused_and_leaves_the_first_and_only_its_records(
    share: ShareLocation,
) -> None:
    first = _writer(share).write(_records(5))
    with pytest.raises(InvalidCheckpointStateError, match="already holds a different commit"):
        _writer(share, "c2").write(_records(6))
    assert _read(share).manifest == first
    assert _names(open_store(share)) == sorted(["manifest.json", first["records_file"]])


def test_the_same_records_under_another_checkpoint_keep_the_shared_object(
    share: ShareLocation,
) -> None:
    first = _writer(share, "c1").write(_records(3))
    with pytest.raises(InvalidCheckpointStateError, match="different commit"):
        _writer(share, "c2").write(_records(3))
    assert _read(share).records == _records(3)
    assert open_store(share).exists(first["records_file"])


@pytest.mark.parametrize("step", WRITE_STEPS)
def test_a_crash_at_each_write_step_leaves_no_manifest_or_a_whole_share(
    share: ShareLocation, spool: Path, step: str
) -> None:
    def on_step(name: str) -> None:
        if name == step:
            raise _Crash(name)

    with pytest.raises(_Crash):
        _writer(share, on_step=on_step).write(_records(30))
    store = open_store(share)
    published = store.exists("manifest.json")
    assert published == (WRITE_STEPS.index(step) >= WRITE_STEPS.index("manifest_linked"))
    if published:
        assert _read(share).records == _records(30)
    else:
        with pytest.raises(InvalidCheckpointStateError, match="partial"):
            _read(share)
    named = WRITE_STEPS.index(step) >= WRITE_STEPS.index("records_renamed")
    assert any(n.startswith("records-") for n in _names(store)) == named
    assert not [n for n in _names(store) if n.startswith(".")], "no temp file is left"
    assert list(spool.iterdir()) == [], "no local spool is left"
    # The retry of the same commit completes the share, or finds it complete.
    manifest = _writer(share).write(_records(30))
    assert _read(share).manifest == manifest


@pytest.mark.parametrize("step", WRITE_STEPS[:3])
def test_a_stop_before_publication_writes_no_object(share: ShareLocation, step: str) -> None:
    writer: RecordsWriter

    def on_step(name: str) -> None:
        if name == step:
            writer.stop()

    writer = _writer(share, on_step=on_step)
    with pytest.raises(InvalidCheckpointStateError, match="stopped"):
        writer.write(_records(3))
    assert _names(open_store(share)) == []


def test_racing_writers_publish_exactly_one_manifest(share: ShareLocation) -> None:
    results: list[Any] = []
    barrier = threading.Barrier(6)

    def run(n: int) -> None:
        barrier.wait()
        try:
            results.append(_writer(share).write(_records(3 + n % 2)))
        except InvalidCheckpointStateError as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = _read(share).manifest
    wins = [r for r in results if isinstance(r, dict)]
    assert wins and all(r == published for r in wins)
    assert all("different commit" in r.detail for r in results if not isinstance(r, dict))
    assert _names(open_store(share)) == sorted(["manifest.json", published["records_file"]])


def test_records_without_a_manifest_are_a_partial_commit(share: ShareLocation) -> None:
    store = open_store(share)
    path = store.spool_directory("") / ".spooled"
    path.write_bytes(b"{}\n")
    store.publish_file("records-" + "0" * 64 + ".jsonl", path)
    with pytest.raises(InvalidCheckpointStateError, match="partial") as caught:
        _read(share)
    assert store.describe("manifest.json") in caught.value.detail


def test_a_changed_records_object_fails_the_read_naming_it(share: ShareLocation) -> None:
    manifest = _writer(share).write(_records(20))
    store = open_store(share)
    data = bytearray(store.read(manifest["records_file"]))
    data[len(data) // 3] ^= 0x20  # still valid JSON, other bytes
    store.replace(manifest["records_file"], bytes(data))
    with pytest.raises(InvalidCheckpointStateError, match="digest") as caught:
        _read(share)
    assert caught.value.detail.startswith(store.describe(manifest["records_file"]))


def test_a_missing_records_object_fails_the_read_naming_both(share: ShareLocation) -> None:
    manifest = _writer(share).write(_records(2))
    store = open_store(share)
    store.delete([manifest["records_file"]])
    with pytest.raises(InvalidCheckpointStateError, match="is missing but") as caught:
        _read(share)
    assert store.describe(manifest["records_file"]) in caught.value.detail
    assert store.describe("manifest.json") in caught.value.detail


@pytest.mark.usefixtures("local_s3")
def test_a_store_that_fails_is_invalid_checkpoint_state_naming_the_share() -> None:
    share = "s3://no-such-bucket-here/ckpt/gym/model/policy"
    with pytest.raises(InvalidCheckpointStateError, match="I/O error writing s3://no-such-bucket"):
        _writer(share).write(_records(2))
    with pytest.raises(InvalidCheckpointStateError, match="s3://no-such-bucket-here/ckpt"):
        _read(share)


@pytest.mark.parametrize("url", ["s3://Not_A_Bucket/x", "s3://midflight/a/../b"])
def test_a_malformed_share_url_is_invalid_checkpoint_state(url: str) -> None:
    with pytest.raises(InvalidCheckpointStateError, match="cannot open the share"):
        _writer(url).write(_records(1))
    with pytest.raises(InvalidCheckpointStateError, match="cannot open the share"):
        _read(url)
