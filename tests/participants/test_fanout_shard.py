"""A shard's dispatch table: every message it answers reaches the right participant call.

A :class:`FanoutShard` joins a stand-in fan-out (a bare channel end on a real Unix socket); the
test sends each message of the fan-out's vocabulary and checks what the shard's participant saw.
The tables of both ends are pinned to the message sets of ``participants._fanout.messages``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, get_args

import anyio
import pytest

from participants import (
    ControlPlane,
    FanoutShard,
    MemoryCaptureLedger,
    ModelParticipant,
    ModelProcessFanout,
    ProcessFanout,
    Record,
    listen_private,
)
from participants._fanout.capabilities import ClaimsCuts, ClaimsRestored, ExportsShares
from participants._fanout.channel import Channel, Dispatch
from participants._fanout.group import ShardConnection
from participants._fanout.messages import (
    CUTS_TO_FANOUT,
    SHARE_TO_SHARD,
    TO_FANOUT,
    TO_SHARD,
    CheckForget,
    Close,
    DeleteRestored,
    ExportRecords,
    ExportShare,
    Forget,
    Install,
    InstallShare,
    Marks,
    Message,
    ModelShare,
    Open,
    Park,
    Readiness,
    Register,
    Registered,
    Report,
    Retire,
    ShardMetrics,
    Stopping,
)
from protocols import CheckpointRequest, EpisodeId, InvalidRequestError

from .fakes import FakeParticipant

pytestmark = pytest.mark.anyio

EPISODE = EpisodeId(rollout_id="r1", attempt=1)


class RecordingParticipant(FakeParticipant):
    """The fake participant, noting every call the shard makes on it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    async def retire(self, episode_id: EpisodeId) -> None:
        self.calls.append(("retire", episode_id))
        await super().retire(episode_id)

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        self.calls.append(("delete_restored", episode_id))
        await super().delete_restored(episode_id)

    async def mark_retired(self, episode_ids: Sequence[EpisodeId]) -> None:
        self.calls.append(("mark_retired", list(episode_ids)))

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.calls.append(("forget", list(rollout_ids)))

    async def park_exported(self, records: Sequence[Record]) -> None:
        self.calls.append(("park_exported", list(records)))

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        self.calls.append(("restore_manifest", manifest))


class SharingParticipant(RecordingParticipant):
    """A participant with the share capability (as the model has)."""

    async def export_share(self, episode_ids: Sequence[EpisodeId] | None) -> dict[str, Any]:
        self.calls.append(("export_share", episode_ids))
        return {"undelivered": ["m1"], "episodes": {}}

    async def install_share(
        self, records: Sequence[Record], scope: Sequence[EpisodeId], options: dict[str, Any]
    ) -> None:
        self.calls.append(("install_share", (list(records), list(scope), options)))


class StandIn:
    """The fan-out end of one shard's channel, answering only what a shard asks on joining."""

    def __init__(self) -> None:
        self.reports: list[Readiness] = []
        self.channel: Channel | None = None

    def dispatch(self) -> Dispatch:
        async def register(message: Register) -> Registered:
            return Registered(generation=0, request=None, marks={})

        async def report(message: Report) -> None:
            self.reports.append(message.readiness)

        async def stopping(message: Stopping) -> None:
            return None

        return Dispatch().on(Register, register).on(Report, report).on(Stopping, stopping)

    async def ask(self, message: Any) -> Any:
        assert self.channel is not None
        return await self.channel.request(message, within=10)


@asynccontextmanager
async def joined(
    tmp_path: Path, participant: RecordingParticipant
) -> AsyncIterator[tuple[StandIn, FanoutShard]]:
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    stand_in = StandIn()
    shard = FanoutShard(ControlPlane(participant), slot=0, socket_path=path, pid=7)
    async with anyio.create_task_group() as group:

        async def accept() -> None:
            stand_in.channel = Channel(await listener.accept(), peer="shard 7")
            await stand_in.channel.serve(stand_in.dispatch())

        group.start_soon(accept)
        async with shard.running():
            yield stand_in, shard
        group.cancel_scope.cancel()
    await listener.aclose()


def _all_messages() -> set[type[Any]]:
    union, _field = get_args(Message)
    return set(get_args(union))


def test_the_four_message_sets_split_the_union() -> None:
    sets = [TO_FANOUT, CUTS_TO_FANOUT, TO_SHARD, SHARE_TO_SHARD]
    assert sum(len(s) for s in sets) == len(_all_messages())
    assert set().union(*sets) == _all_messages()


def test_each_end_answers_exactly_its_set(tmp_path: Path) -> None:
    plain = FanoutShard(ControlPlane(RecordingParticipant()), slot=0, socket_path="unused")
    sharing = FanoutShard(ControlPlane(SharingParticipant()), slot=0, socket_path="unused")
    assert plain.dispatch().kinds() == TO_SHARD
    assert sharing.dispatch().kinds() == TO_SHARD | SHARE_TO_SHARD
    connection = ShardConnection(None, None)  # type: ignore[arg-type]  # only the table is read
    assert ProcessFanout("environment", "e", expected=2).dispatch(connection).kinds() == TO_FANOUT
    model = ModelProcessFanout("policy", expected=2)
    assert model.dispatch(connection).kinds() == TO_FANOUT | CUTS_TO_FANOUT


def test_capabilities_are_what_the_participants_offer() -> None:
    model = ModelParticipant(MemoryCaptureLedger())
    assert isinstance(model, ExportsShares) and isinstance(model, ClaimsCuts)
    assert not isinstance(model, ClaimsRestored)
    plain = RecordingParticipant()
    assert not isinstance(plain, ExportsShares | ClaimsCuts | ClaimsRestored)
    shard = FanoutShard(ControlPlane(model), slot=0, socket_path="unused")
    assert shard.shares is model
    assert model.claim_cut == shard.claim_cut and model.return_cut == shard.return_cut


async def test_every_message_reaches_its_participant_call(tmp_path: Path) -> None:
    participant = RecordingParticipant()
    async with joined(tmp_path, participant) as (fanout, shard):
        request = CheckpointRequest(checkpoint_id="c1", deadline_ts=time.time() + 60)
        readiness = await fanout.ask(Close(request=request, generation=4))
        assert readiness.generation == 4 and shard.closed and not participant.admission_open
        assert participant.close_calls == 1
        await fanout.ask(Open())
        assert participant.admission_open and not shard.closed

        await fanout.ask(Marks(marks={"r1": 2}))
        assert participant.calls.pop() == ("mark_retired", [EpisodeId(rollout_id="r1", attempt=2)])
        assert shard.plane.marks.is_retired(EpisodeId(rollout_id="r1", attempt=1))

        await fanout.ask(Retire(episode_ids=[EPISODE]))
        assert participant.calls.pop() == ("retire", EPISODE)
        await fanout.ask(DeleteRestored(episode_ids=[EPISODE]))
        assert participant.calls.pop() == ("delete_restored", EPISODE)

        await fanout.ask(CheckForget(rollout_ids=["r1"]))
        assert participant.calls.pop() == ("forget", ["r1"])
        assert shard.plane.marks.is_retired(EpisodeId(rollout_id="r1", attempt=1))  # only checked
        await fanout.ask(Forget(rollout_ids=["r1"]))
        assert not shard.plane.marks.is_retired(EpisodeId(rollout_id="r1", attempt=1))
        assert participant.calls == []  # forgetting the marks is the shard's own

        record = {"episode_id": EPISODE.model_dump(), "step": 2}
        await fanout.ask(Install(records=[record], scope=[EPISODE], manifest={"m": 1}))
        assert participant.calls.pop() == ("restore_manifest", {"m": 1})
        assert participant.installed == [[record]]
        exported = await fanout.ask(ExportRecords(scope=None))
        assert exported == participant.exports[-1] and exported
        await fanout.ask(Park())
        assert participant.calls.pop() == ("park_exported", exported)

        metrics = await fanout.ask(ShardMetrics())
        assert "midflight_" in metrics

        with pytest.raises(InvalidRequestError, match="export_share is not answered here"):
            await fanout.ask(ExportShare(scope=[EPISODE]))
    assert participant.calls == []


async def test_a_sharing_participant_answers_share_messages(tmp_path: Path) -> None:
    participant = SharingParticipant()
    async with joined(tmp_path, participant) as (fanout, _shard):
        share = await fanout.ask(ExportShare(scope=[EPISODE]))
        assert share == ModelShare(undelivered=["m1"], episodes={})
        assert participant.calls.pop() == ("export_share", [EPISODE])
        install = InstallShare(
            records=[],
            scope=[EPISODE],
            manifest=None,
            import_ledger=True,
            targets=["r1-a1"],
            cut_keys=[],
        )
        await fanout.ask(install)
        options = {"import": True, "targets": ["r1-a1"], "cut_keys": []}
        assert participant.calls.pop() == ("install_share", ([], [EPISODE], options))
    assert participant.calls == []


async def test_a_joining_shard_reports_first(tmp_path: Path) -> None:
    async with joined(tmp_path, RecordingParticipant()) as (fanout, _shard):
        with anyio.fail_after(10):
            while not fanout.reports:  # noqa: ASYNC110 - another task's state
                await anyio.sleep(0.01)
        assert fanout.reports[0].seq >= 1 and fanout.reports[0].report.ready
