"""Commit into, and restore from, an ``s3://`` checkpoint over HTTP (in-process, real S3 API).

Each participant here is served by ``participant_app`` through ``httpx.ASGITransport``; the
checkpoint root is a fresh prefix of moto's S3 server (``s3_root``), so every object the tests
look at went through obstore and the S3 REST API.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e._launch.object_store import LocalS3
from participants import (
    WRITE_STEPS,
    ControlPlane,
    ControlSettings,
    ManualClock,
    RecordsWriter,
    participant_app,
    read_participant_checkpoint,
)
from protocols import CONTROL_PREFIX, Phase, open_store

from .fakes import FakeParticipant
from .runtime_support import NOW, ep

pytestmark = pytest.mark.anyio
TOKEN = "s3-token"
SHARE = "gym/environment/fake"


@dataclass
class Served:
    http: httpx.AsyncClient
    plane: ControlPlane
    fake: FakeParticipant

    async def call(self, route: str, **body: Any) -> httpx.Response:
        body.setdefault("deadline_ts", NOW + 60)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return await self.http.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=headers)

    async def ok(self, route: str, **body: Any) -> dict[str, Any]:
        response = await self.call(route, **body)
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    async def commit(self, checkpoint_id: str, directory: str, *rollouts: str) -> httpx.Response:
        scope = [ep(r).model_dump() for r in rollouts]
        return await self.call(
            "commit", checkpoint_id=checkpoint_id, checkpoint_dir=directory, episode_ids=scope
        )

    async def restore(self, checkpoint_id: str, directory: str, *rollouts: str) -> httpx.Response:
        scope = [ep(r).model_dump() for r in rollouts]
        return await self.call(
            "restore", checkpoint_id=checkpoint_id, checkpoint_dir=directory, episode_ids=scope
        )


@asynccontextmanager
async def served(
    root: Path | str | None, on_write_step: Any = None, *rollouts: str
) -> AsyncIterator[Served]:
    """A fresh participant process, serving its control routes, running ``rollouts``."""
    fake = FakeParticipant()
    for rollout in rollouts:
        fake.start(ep(rollout))
    plane = ControlPlane(
        fake,
        clock=ManualClock(NOW),
        settings=ControlSettings(checkpoint_root=root),
        on_write_step=on_write_step,
    )
    transport = httpx.ASGITransport(app=participant_app(plane, token=TOKEN))
    async with plane.running(), httpx.AsyncClient(transport=transport, base_url="http://p") as http:
        yield Served(http, plane, fake)


def _error(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["detail"]


def _keys(local_s3: LocalS3, location: str) -> list[str]:
    """The keys of every object under ``location`` (an ``s3://midflight/…`` URL), via LIST."""
    return sorted(local_s3.object_keys(location.removeprefix(f"s3://{local_s3.bucket}/")))


async def test_a_commit_into_s3_restores_in_a_fresh_process(
    s3_root: str, local_s3: LocalS3
) -> None:
    directory = f"{s3_root}/checkpoints/c1"
    async with served(s3_root, None, "a", "b") as p:
        p.fake.end_step("a")  # a's record says step 1, b's step 0
        await p.ok("prepare", checkpoint_id="c1")
        response = await p.commit("c1", directory, "a", "b")
        assert response.status_code == 200, response.text
        manifest = response.json()["manifest"]
        exported = p.fake.exports[-1]
    share = open_store(f"{directory}/{SHARE}")
    body = share.read(manifest["records_file"])
    assert hashlib.sha256(body).hexdigest() == manifest["records_sha256"]
    assert manifest["record_count"] == 2 and manifest["checkpoint_id"] == "c1"
    assert _keys(local_s3, s3_root) == [
        f"{share.url.split('/', 3)[3]}/{name}"
        for name in ("manifest.json", manifest["records_file"])
    ]
    async with served(s3_root) as fresh:
        reply = await fresh.ok(
            "restore",
            checkpoint_id="r1",
            checkpoint_dir=directory,
            episode_ids=[ep("a").model_dump(), ep("b").model_dump()],
        )
        assert reply["source_checkpoint_id"] == "c1"
        assert reply["restored"] == ["a-a1", "b-a1"]
        assert fresh.fake.installed == [exported]
        assert fresh.fake.restored["a-a1"]["step"] == 1


@pytest.mark.parametrize(
    "where",
    [
        "{root}-other/c1",  # a sibling prefix that merely starts like the root
        "s3://another-bucket/c1",
        "{root}/../escape/c1",
        "{root}/a/../../escape",
        "{root}/c1/./x",
        "/tmp/ckpt",  # a path under an s3:// root
    ],
)
async def test_a_checkpoint_dir_not_under_the_s3_root_is_refused_and_writes_nothing(
    s3_root: str, local_s3: LocalS3, where: str
) -> None:
    directory = where.format(root=s3_root)
    async with served(s3_root, None, "a") as p:
        await p.ok("prepare", checkpoint_id="c1")
        status, code, detail = _error(await p.commit("c1", directory, "a"))
        assert (status, code) == (422, "invalid_request")
        assert "\n" not in detail and "nothing was read or written" in detail
        assert p.plane.phase is Phase.PREPARED and p.fake.export_calls == 0
        status, code, _ = _error(await p.restore("r1", directory, "a"))
        assert (status, code) == (422, "invalid_request")
    assert local_s3.object_keys(s3_root.split("/", 3)[3]) == []  # the root and its siblings


@pytest.mark.parametrize("root", ["directory", None])
async def test_an_s3_checkpoint_dir_needs_an_s3_root(
    s3_root: str, local_s3: LocalS3, tmp_path: Path, root: str | None
) -> None:
    async with served(tmp_path if root else None, None, "a") as p:
        await p.ok("prepare", checkpoint_id="c1")
        status, code, detail = _error(await p.commit("c1", f"{s3_root}/c1", "a"))
        assert (status, code) == (422, "invalid_request")
        assert ("is a directory" if root else "no checkpoint root") in detail
        assert p.plane.phase is Phase.PREPARED
    assert _keys(local_s3, s3_root) == [] and list(tmp_path.iterdir()) == []


async def test_a_different_commit_into_the_same_share_is_refused_and_the_first_kept(
    s3_root: str, local_s3: LocalS3
) -> None:
    directory = f"{s3_root}/checkpoints/shared"
    async with served(s3_root, None, "a") as p:
        await p.ok("prepare", checkpoint_id="c1")
        first = (await p.commit("c1", directory, "a")).json()["manifest"]
        await p.ok("resume", checkpoint_id="c1")
        await p.ok("prepare", checkpoint_id="c2")
        status, code, detail = _error(await p.commit("c2", directory, "a"))  # another export
        assert (status, code) == (422, "invalid_checkpoint_state")
        assert "already holds a different commit" in detail and directory in detail
    share = f"{directory}/{SHARE}"
    kept = read_participant_checkpoint(share, kind="environment", instance="fake")
    assert kept.manifest == first
    names = [key.rsplit("/", 1)[1] for key in _keys(local_s3, share)]
    assert names == sorted(["manifest.json", first["records_file"]])


async def test_an_identical_repeat_of_the_commit_returns_the_same_manifest(
    s3_root: str, local_s3: LocalS3
) -> None:
    directory = f"{s3_root}/checkpoints/c1"
    async with served(s3_root, None, "a") as p:
        await p.ok("prepare", checkpoint_id="c1")
        first = await p.commit("c1", directory, "a")
        retried = await p.commit("c1", directory, "a")  # the answer was lost: the same reply
        assert retried.json() == first.json()
    before = _keys(local_s3, s3_root)
    # A fresh process repeats the same commit (its first answer lost): the same bytes are its own.
    async with served(s3_root, None, "a") as again:
        await again.ok("prepare", checkpoint_id="c1")
        repeat = await again.commit("c1", directory, "a")
        assert repeat.status_code == 200, repeat.text
        assert repeat.json()["manifest"] == first.json()["manifest"]
    assert _keys(local_s3, s3_root) == before


async def test_a_share_with_records_but_no_manifest_is_refused_by_restore(s3_root: str) -> None:
    directory = f"{s3_root}/checkpoints/partial"

    def crash(step: str) -> None:
        if step == "manifest_temp_synced":
            raise RuntimeError("killed before the manifest")

    writer = RecordsWriter(
        f"{directory}/{SHARE}",
        kind="environment",
        instance="fake",
        checkpoint_id="c1",
        on_step=crash,
    )
    with pytest.raises(RuntimeError):
        writer.write([{"episode_id": ep("a").model_dump(), "step": 1}])
    (records,) = open_store(directory).list_objects("")  # a crashed commit's records only
    assert records.key.startswith(f"{SHARE}/records-")
    async with served(s3_root) as fresh:
        status, code, detail = _error(await fresh.restore("r1", directory, "a"))
        assert (status, code) == (422, "invalid_checkpoint_state")
        assert "partial" in detail and f"{directory}/{SHARE}/manifest.json" in detail
        assert fresh.fake.installed == [] and fresh.plane.phase is Phase.IDLE


@pytest.mark.parametrize("step", WRITE_STEPS)
async def test_a_write_failing_at_any_step_leaves_no_manifest_or_a_whole_share(
    s3_root: str, step: str
) -> None:
    directory = f"{s3_root}/checkpoints/c1"
    failures = [step]

    def fail_once(name: str) -> None:
        if name in failures:
            failures.remove(name)
            raise OSError(5, f"injected failure at {name}")

    async with served(s3_root, fail_once, "a") as p:
        await p.ok("prepare", checkpoint_id="c1")
        status, code, detail = _error(await p.commit("c1", directory, "a"))
        assert (status, code) == (422, "invalid_checkpoint_state") and directory in detail
        share = open_store(f"{directory}/{SHARE}")
        assert share.exists("manifest.json") == (
            WRITE_STEPS.index(step) >= WRITE_STEPS.index("manifest_linked")
        )
        retried = await p.commit("c1", directory, "a")  # the same export, written again
        assert retried.status_code == 200, retried.text
    shared = read_participant_checkpoint(
        f"{directory}/{SHARE}", kind="environment", instance="fake"
    )
    assert shared.manifest == retried.json()["manifest"]
