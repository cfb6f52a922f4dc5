"""The evidence log's group commit (D386): appends from many threads share a write and a sync,
each returns only once a sync covers its own line, and a failed sync fails exactly the appends
it carried. Real files; ``os.write`` and ``os.fsync`` are wrapped to watch them, not replaced
(or to fail one sync)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e._servers.evidence import EvidenceLog, read_evidence


class _Disk:
    """Counts bytes written and bytes made durable by the evidence module's calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, sync: Callable[[int], None]) -> None:
        self.written = 0
        self.durable = 0
        self.syncs = 0
        real_write, real_fsync = os.write, os.fsync

        def write(fd: int, data: bytes) -> int:
            count = real_write(fd, data)
            self.written += count
            return count

        def fsync(fd: int) -> None:
            self.syncs += 1
            sync(self.syncs)
            real_fsync(fd)
            self.durable = self.written

        monkeypatch.setattr(os, "write", write)  # the evidence module's calls go through these
        monkeypatch.setattr(os, "fsync", fsync)


def test_appends_from_many_threads_share_syncs_and_each_waits_for_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 2,000 rollouts in flight the policy server's threads queued on one lock for one fsync
    per line: 23 % of its samples."""
    log = EvidenceLog(tmp_path / "evidence" / "policy.jsonl")
    log.path.touch()  # no directory sync among the ones counted
    disk = _Disk(monkeypatch, sync=lambda _n: time.sleep(0.002))
    durable_at_return: dict[str, int] = {}

    def writer(thread: int) -> None:
        for index in range(40):
            key = f"t{thread}-{index}"
            log.append({"event": "admit", "key": key})
            durable_at_return[key] = disk.durable

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    data = log.path.read_bytes()
    ends: dict[str, int] = {}
    offset = 0
    for line in data.splitlines(keepends=True):
        offset += len(line)
        ends[json.loads(line)["key"]] = offset
    assert len(ends) == 320 and len(data.splitlines()) == 320  # each line once, none torn
    late = [key for key, end in ends.items() if durable_at_return[key] < end]
    assert not late, f"appends returned before a sync covered their line: {late[:5]}"
    assert disk.syncs < 320 / 2, f"{disk.syncs} syncs for 320 lines"  # one per line before


def test_a_failed_sync_fails_the_appends_it_carried_and_no_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_sync = threading.Event()

    def sync(n: int) -> None:
        if n == 1:
            first_sync.wait(10)  # the leader holds the write while three more lines queue
        elif n == 2:
            raise OSError(5, "the disk failed")

    log = EvidenceLog(tmp_path / "driver.jsonl")
    log.path.touch()  # no directory sync among the ones counted
    _Disk(monkeypatch, sync=sync)
    outcomes: dict[str, str] = {}

    def append(key: str) -> None:
        try:
            log.append({"key": key})
            outcomes[key] = "ok"
        except OSError:
            outcomes[key] = "failed"

    leader = threading.Thread(target=append, args=("a",))
    leader.start()
    while log._queued < 1 or not log._writing:
        time.sleep(0.001)
    followers = [threading.Thread(target=append, args=(key,)) for key in ("b", "c", "d")]
    for follower in followers:
        follower.start()
    while log._queued < 4:
        time.sleep(0.001)
    first_sync.set()
    for thread in (leader, *followers):
        thread.join(10)
    append("e")  # after the failure: a sync of its own
    assert outcomes == {"a": "ok", "b": "failed", "c": "failed", "d": "failed", "e": "ok"}
    assert [event["key"] for event in read_evidence(log.path)] == ["a", "b", "c", "d", "e"]
