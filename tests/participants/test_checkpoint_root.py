"""Commit and restore touch only checkpoint directories under the configured root (D240)."""

from __future__ import annotations

from pathlib import Path

import pytest

from participants import read_participant_checkpoint
from protocols import InvalidRequestError, Phase

from .runtime_support import Harness, commit_req, ep, harness, req, restore_req

pytestmark = pytest.mark.anyio


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _escapes(root: Path, outside: Path) -> list[str]:
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    return [
        str(outside / "ckpt"),  # plainly elsewhere
        str(root / ".." / "outside" / "ckpt"),  # `..` that leaves the root
        str(root / "link-out" / "ckpt"),  # a symlink inside the root that leads out
        "/",
    ]


async def _prepared(h: Harness) -> None:
    h.fake.start(ep("a"))
    reply = await h.plane.prepare(req())
    assert reply.phase is Phase.PREPARED


async def test_a_commit_outside_the_checkpoint_root_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    async with harness(tmp_path, checkpoint_root=root) as h:
        await _prepared(h)
        for directory in _escapes(root, outside):
            with pytest.raises(InvalidRequestError, match="outside the checkpoint root"):
                await h.plane.commit(commit_req(directory, [ep("a")]))
            assert h.plane.phase is Phase.PREPARED  # nothing changed
        assert _tree(outside) == []
        assert h.fake.export_calls == 0
        reply = await h.plane.commit(commit_req(str(root / "checkpoints" / "c1"), [ep("a")]))
        assert reply.phase is Phase.COMMITTED


@pytest.mark.parametrize("rooted", [True, False])
async def test_a_checkpoint_dir_with_a_nul_is_refused_whether_or_not_there_is_a_root(
    tmp_path: Path, rooted: bool
) -> None:
    # The file system refuses such a name with ValueError, which was a 500 (D362).
    root = tmp_path / "root"
    root.mkdir()
    async with harness(tmp_path, checkpoint_root=root if rooted else None) as h:
        await _prepared(h)
        nul = f"{root}/c\x001"
        with pytest.raises(InvalidRequestError, match="NUL character"):
            await h.plane.commit(commit_req(nul, [ep("a")]))
        assert h.plane.phase is Phase.PREPARED and h.fake.export_calls == 0
        await h.plane.resume(req())
    async with harness(tmp_path, checkpoint_root=root if rooted else None) as h:
        with pytest.raises(InvalidRequestError, match="NUL character"):
            await h.plane.restore(restore_req(nul, [ep("a")]))
        assert h.plane.phase is Phase.IDLE and h.fake.installed == []
    assert _tree(root) == []


async def test_a_symlink_below_the_checkpoint_directory_cannot_lead_out(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ck" / "gym" / "environment").mkdir(parents=True)
    outside.mkdir()
    (root / "ck" / "gym" / "environment" / "fake").symlink_to(outside, target_is_directory=True)
    async with harness(tmp_path, checkpoint_root=root) as h:
        await _prepared(h)
        with pytest.raises(InvalidRequestError, match="outside the checkpoint root"):
            await h.plane.commit(commit_req(str(root / "ck"), [ep("a")]))
        assert _tree(outside) == []


async def test_a_restore_from_outside_the_checkpoint_root_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    # A real checkpoint outside the root: a restore must not even read it.
    async with harness(tmp_path) as writer:
        await _prepared(writer)
        await writer.plane.commit(commit_req(str(outside / "ckpt"), [ep("a")]))
    assert read_participant_checkpoint(
        outside / "ckpt" / "gym" / "environment" / "fake", kind="environment", instance="fake"
    ).records
    async with harness(tmp_path, checkpoint_root=root) as h:
        for directory in _escapes(root, outside):
            with pytest.raises(InvalidRequestError, match="outside the checkpoint root"):
                await h.plane.restore(restore_req(directory, [ep("a")]))
            assert h.plane.phase is Phase.IDLE
            assert h.fake.restored == {}


async def test_a_root_named_through_a_symlink_accepts_its_own_checkpoints(tmp_path: Path) -> None:
    real = tmp_path / "real-root"
    real.mkdir()
    (tmp_path / "root").symlink_to(real, target_is_directory=True)
    async with harness(tmp_path, checkpoint_root=tmp_path / "root") as h:
        await _prepared(h)
        reply = await h.plane.commit(commit_req(str(tmp_path / "root" / "c1"), [ep("a")]))
        assert reply.phase is Phase.COMMITTED
        assert (real / "c1" / "gym" / "environment" / "fake" / "manifest.json").exists()
