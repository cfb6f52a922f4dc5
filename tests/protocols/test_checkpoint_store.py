"""The checkpoint store's guarantees, on a directory and on a real S3 API (moto's server).

Each test runs on both stores: the same calls must give the same answers, because the
participants and the coordinator write through this interface and nothing else (D327).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from protocols import CheckpointStore, ObjectMissingError, key_under, open_store, store_key


@pytest.fixture(params=["posix", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "posix":
        return open_store(tmp_path / "root")
    return open_store(request.getfixturevalue("s3_root"))


def _spooled(store: CheckpointStore, prefix: str, data: bytes) -> Path:
    spool = store.spool_directory(prefix) / f".spool-{threading.get_ident()}"
    spool.write_bytes(data)
    return spool


def test_create_writes_once_and_refuses_a_second_writer(store: CheckpointStore) -> None:
    assert store.create("a/manifest.json", b"first")
    assert not store.create("a/manifest.json", b"second")
    assert store.read("a/manifest.json") == b"first"
    # The same bytes again: on S3 that is the writer's own retry whose first answer was lost, so
    # it counts as written; a directory's link refuses it, and the records writer then finds the
    # identical manifest itself. Either way the object is unchanged.
    assert store.create("a/manifest.json", b"first") is store.url.startswith("s3://")
    assert store.read("a/manifest.json") == b"first"


def test_of_many_racing_creators_exactly_one_wins(store: CheckpointStore) -> None:
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def create(n: int) -> None:
        barrier.wait()
        results.append(store.create("race/manifest.json", f"writer {n}".encode()))

    threads = [threading.Thread(target=create, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 5 + [True]


def test_replace_if_moves_only_the_version_that_was_read(store: CheckpointStore) -> None:
    assert store.read_versioned("checkpoints/LATEST") is None
    assert store.replace_if("checkpoints/LATEST", b"ckpt-1", None)
    assert not store.replace_if("checkpoints/LATEST", b"ckpt-x", None)  # no longer absent
    read = store.read_versioned("checkpoints/LATEST")
    assert read is not None and read[0] == b"ckpt-1"
    assert store.replace_if("checkpoints/LATEST", b"ckpt-2", read[1])
    assert not store.replace_if("checkpoints/LATEST", b"ckpt-3", read[1])  # a stale version
    assert store.read("checkpoints/LATEST") == b"ckpt-2"


def test_of_two_racing_publishers_exactly_one_moves_latest(store: CheckpointStore) -> None:
    store.replace("checkpoints/LATEST", b"ckpt-0")
    read = store.read_versioned("checkpoints/LATEST")
    assert read is not None
    results: dict[str, bool] = {}
    barrier = threading.Barrier(2)

    def publish(name: str) -> None:
        barrier.wait()
        results[name] = store.replace_if("checkpoints/LATEST", name.encode(), read[1])

    threads = [threading.Thread(target=publish, args=(n,)) for n in ("ckpt-a", "ckpt-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results.values()) == [False, True]
    winner = next(name for name, won in results.items() if won)
    assert store.read("checkpoints/LATEST") == winner.encode()


def test_a_published_file_is_read_back_line_by_line(store: CheckpointStore) -> None:
    lines = [b'{"n": %d, "pad": "%s"}\n' % (n, b"x" * (n % 7) * 1000) for n in range(3000)]
    store.publish_file("c/records-1.jsonl", _spooled(store, "c", b"".join(lines)))
    assert list(store.lines("c/records-1.jsonl")) == lines
    # Content-addressed: publishing the same name again keeps the object as it is.
    store.publish_file("c/records-1.jsonl", _spooled(store, "c", b"".join(lines)))
    assert store.read("c/records-1.jsonl") == b"".join(lines)


def test_missing_objects_are_typed(store: CheckpointStore) -> None:
    with pytest.raises(ObjectMissingError):
        store.read("nothing/here")
    with pytest.raises(ObjectMissingError):
        list(store.lines("nothing/here"))
    assert not store.exists("nothing/here")


def test_list_subdirectories_and_delete(store: CheckpointStore) -> None:
    for key in ("checkpoints/c1/checkpoint.json", "checkpoints/c1/gym/model/m/manifest.json"):
        store.replace(key, b"{}")
    store.replace("checkpoints/c2/gym/agent/a/manifest.json", b"{}")
    store.replace("checkpoints/LATEST", b"c1")
    assert store.subdirectories("checkpoints") == ["c1", "c2"]
    assert [o.key for o in store.list_objects("checkpoints/c1")] == [
        "checkpoints/c1/checkpoint.json",
        "checkpoints/c1/gym/model/m/manifest.json",
    ]
    assert all(o.size == 2 and o.modified > 0 for o in store.list_objects("checkpoints"))
    store.delete(["checkpoints/c1/checkpoint.json", "checkpoints/c1/never-was"])
    assert not store.exists("checkpoints/c1/checkpoint.json")
    store.delete_tree("checkpoints/c2")
    assert store.subdirectories("checkpoints") == ["c1"]
    assert store.read("checkpoints/LATEST") == b"c1"


def test_keys_stay_inside_the_root(store: CheckpointStore) -> None:
    for bad in ("../x", "a/../../x", "a//b", "/etc/passwd", "a/./b", ".hidden"):
        with pytest.raises(ValueError):
            store.read(bad)
    assert store_key("checkpoints", "c1/gym") == "checkpoints/c1/gym"
    inside = f"{store.url}/checkpoints/c1"
    assert key_under(store, inside) == "checkpoints/c1"
    with pytest.raises(ValueError):
        key_under(store, f"{store.url}-other/checkpoints/c1")
