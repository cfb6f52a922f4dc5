"""Restore reads and installs its records as one batch: scope index, collector paused."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import participants._runtime.restore as transfer
from participants import RecordsWriter
from participants._runtime.collector import pauses_active
from participants._runtime.restore_batch import RestoreScope
from protocols import CheckpointConflictError, EpisodeId, InvalidCheckpointStateError, Phase

from .runtime_support import ep, harness, restore_req

pytestmark = pytest.mark.anyio


def _checkpoint(root: Path, records: list[dict[str, Any]]) -> str:
    """A published share of the fake participant (environment/fake) holding ``records``."""
    directory = root / "ckpt"
    RecordsWriter(
        directory / "gym" / "environment" / "fake",
        kind="environment",
        instance="fake",
        checkpoint_id="c1",
    ).write(records)
    return str(directory)


def _record(rollout_id: str, attempt: Any = 0, step: int = 1) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, "step": step}


async def test_restore_keeps_the_scope_and_hands_install_the_indexed_scope(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, [_record("a"), _record("c"), _record("b", 1, step=2)])
    async with harness(tmp_path) as h:
        seen: list[Sequence[EpisodeId]] = []
        install = h.fake.install

        async def recording(records: Sequence[dict[str, Any]], scope: Sequence[EpisodeId]) -> None:
            seen.append(scope)
            await install(records, scope)

        h.fake.install = recording  # type: ignore[method-assign]
        reply = await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
    assert reply.restored == ["a-a1", "b-a2"]  # c is outside the scope: not read in
    assert sorted(h.fake.restored) == ["a-a1", "b-a2"]
    (scope,) = seen
    assert isinstance(scope, RestoreScope) and list(scope) == [ep("a"), ep("b", 1)]


@pytest.mark.parametrize(
    "bad",
    [
        _record("b", True),  # a bool looks like attempt 1 to a dict lookup; strict says no
        {"episode_id": {"rollout_id": "b", "attempt": 1, "x": 0}, "step": 1},
        _record("b-a1", 0),  # the capture key of a scoped attempt, but not a valid rollout id
    ],
)
async def test_a_record_validation_refuses_is_not_taken_for_a_scoped_one(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    directory = _checkpoint(tmp_path, [_record("a"), bad])
    async with harness(tmp_path) as h:
        with pytest.raises(InvalidCheckpointStateError, match="record 1 has no valid episode_id"):
            await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
        assert h.fake.installed == [] and h.fake.admission_open
        assert h.plane.phase is Phase.IDLE


async def test_the_collector_is_paused_while_records_are_read_and_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _checkpoint(tmp_path, [_record("a")])
    observed: dict[str, tuple[bool, int]] = {}
    read = transfer.read_participant_checkpoint

    def reading(*args: Any, **kwargs: Any) -> Any:
        observed["read"] = (gc.isenabled(), pauses_active())
        return read(*args, **kwargs)

    monkeypatch.setattr(transfer, "read_participant_checkpoint", reading)
    gc.enable()
    async with harness(tmp_path) as h:
        install = h.fake.install

        async def installing(records: Any, scope: Any) -> None:
            observed["install"] = (gc.isenabled(), pauses_active())
            await install(records, scope)

        h.fake.install = installing  # type: ignore[method-assign]
        await h.plane.restore(restore_req(directory, [ep("a")]))
    assert observed == {"read": (False, 1), "install": (False, 1)}
    assert gc.isenabled() and pauses_active() == 0


async def test_a_failed_install_turns_the_collector_back_on(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, [_record("a")])
    gc.enable()
    async with harness(tmp_path) as h:
        h.fake.fail_install = InvalidCheckpointStateError("record 0 is not valid")
        with pytest.raises(InvalidCheckpointStateError):
            await h.plane.restore(restore_req(directory, [ep("a")]))
    assert gc.isenabled() and pauses_active() == 0


@pytest.mark.parametrize(
    "retry",
    [
        [ep("a"), ep("b", 1), ep("c")],  # one attempt more
        [ep("a")],  # one attempt fewer
        [ep("a"), ep("b", 2)],  # another attempt of a scoped rollout
        [ep("a", 1), ep("b", 1)],  # the next attempt's own capture key
    ],
)
async def test_a_restore_retried_under_another_scope_conflicts_and_installs_nothing_more(
    tmp_path: Path, retry: list[EpisodeId]
) -> None:
    directory = _checkpoint(tmp_path, [_record("a"), _record("c"), _record("b", 1, step=2)])
    async with harness(tmp_path) as h:
        reply = await h.plane.restore(restore_req(directory, [ep("a"), ep("b", 1)]))
        # The same attempts again, reordered and one named twice: the same call (D449).
        again = await h.plane.restore(restore_req(directory, [ep("b", 1), ep("a"), ep("b", 1)]))
        assert again == reply
        with pytest.raises(CheckpointConflictError):
            await h.plane.restore(restore_req(directory, retry))
    assert sorted(h.fake.restored) == ["a-a1", "b-a2"]
