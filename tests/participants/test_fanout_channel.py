"""The fan-out channel: every message and its reply cross it typed; a bad frame is refused typed.

Two real channel ends on a Unix socket, in-process. A message of each kind goes one way and its
reply comes back equal; a frame with an unknown kind, a malformed message, or a message this end
does not answer gets ``invalid_request`` and the connection goes on; a reply that is not what its
message names is an ``internal_error`` for the caller.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, get_args

import anyio
import pytest
from anyio.abc import ByteStream
from structlog.testing import capture_logs

import participants._fanout.channel as channel_module
from participants import listen_private
from participants._fanout.channel import Channel, Dispatch, connect
from participants._fanout.messages import (
    Ask,
    CheckForget,
    Claim,
    ClaimCut,
    Close,
    Control,
    DeleteRestored,
    EpisodeShare,
    ExportRecords,
    ExportShare,
    Forget,
    GatherMetrics,
    Health,
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
    ReturnCut,
    ServerHealth,
    ServerMetrics,
    ShardMetrics,
    Stopping,
)
from protocols import (
    CheckpointRequest,
    EpisodeId,
    GenerationCutRecord,
    InternalError,
    InvalidRequestError,
    PrepareReport,
    StaleAttemptError,
)
from protocols._cuts import GenerationCutContinuation

pytestmark = pytest.mark.anyio

DIGEST = "a" * 64
EPISODE = EpisodeId(rollout_id="r1", attempt=2)
REQUEST = CheckpointRequest(checkpoint_id="c1", deadline_ts=1_900_000_000.5)
CUT = GenerationCutRecord(
    model_call_id="c1",
    request_digest=DIGEST,
    continuation=GenerationCutContinuation(
        source_capture_key="r1-a1",
        source_model_call_id="c0",
        staging_keys=["__generation_cut__/c0/1"],
        prefix_token_count=4,
        prefix_digest=DIGEST,
        effective_output_limit=32,
    ),
)
READINESS = Readiness(
    generation=3,
    seq=7,
    report=PrepareReport(
        ready=False, blockers=["r1"], blocker_count=1, counts={"episodes": 2}, restarts=[]
    ),
    served=True,
    restored_pending=["r2-a1"],
    extra={"waiting": 1, "restored_pending": ["r2-a1"]},
)
RECORD = {"episode_id": EPISODE.model_dump(), "step": 3, "nested": {"a": [1, 2.5, None]}}

EXAMPLES: dict[type[Ask[Any]], tuple[Ask[Any], Any]] = {
    Register: (
        Register(pid=101, slot=1),
        Registered(generation=2, request=REQUEST, marks={"r1": 2}),
    ),
    Report: (Report(readiness=READINESS), None),
    Stopping: (Stopping(pid=101), None),
    Claim: (Claim(capture_key="r1-a2"), True),
    Control: (Control(operation="prepare", body='{"x": 1}'), {"phase": "prepared"}),
    GatherMetrics: (GatherMetrics(), ServerMetrics(main="a 1.0\n", shards=["b 2.0\n", "c 3.0\n"])),
    Health: (Health(), ServerHealth(ready=False, workers=1, expected=2, missing_slots=[0])),
    ClaimCut: (ClaimCut(capture_key="r1-a2", request_digest=DIGEST), CUT),
    ReturnCut: (ReturnCut(capture_key="r1-a2", record=CUT), None),
    Close: (Close(request=REQUEST, generation=3), READINESS),
    Open: (Open(), None),
    Marks: (Marks(marks={"r1": 2, "r9": 1}), None),
    Retire: (Retire(episode_ids=[EPISODE]), None),
    DeleteRestored: (DeleteRestored(episode_ids=[EPISODE]), None),
    CheckForget: (CheckForget(rollout_ids=["r1", "r2"]), None),
    Forget: (Forget(rollout_ids=["r1"]), None),
    ExportRecords: (ExportRecords(scope=[EPISODE]), [RECORD]),
    Install: (Install(records=[RECORD], scope=[EPISODE], manifest={"checkpoint_id": "c1"}), None),
    Park: (Park(), None),
    ShardMetrics: (ShardMetrics(), "x_total 1.0\n"),
    ExportShare: (
        ExportShare(scope=[EPISODE]),
        ModelShare(
            undelivered=["m1"],
            episodes={"r1-a2": EpisodeShare(rows=[{"k": 1}], cut=CUT, cut_admitted_at=12.5)},
        ),
    ),
    InstallShare: (
        InstallShare(
            records=[RECORD],
            scope=[EPISODE],
            manifest=None,
            import_ledger=True,
            targets=["r1-a2"],
            cut_keys=["r1-a2"],
        ),
        None,
    ),
}


def _union_members() -> set[type[Any]]:
    union, _field = get_args(Message)
    return set(get_args(union))


def test_every_message_of_the_union_has_an_example() -> None:
    assert set(EXAMPLES) == _union_members()
    assert all(type(message) is kind for kind, (message, _reply) in EXAMPLES.items())


@asynccontextmanager
async def channels(tmp_path: Path, far: Dispatch) -> AsyncIterator[Channel]:
    """A near end (asks) and a far end answering with ``far``, on a real Unix socket."""
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    async with anyio.create_task_group() as group:
        near = await connect(path, peer="far")
        far_end = Channel(await listener.accept(), peer="near")
        group.start_soon(near.serve, Dispatch())
        group.start_soon(far_end.serve, far)
        yield near
        group.cancel_scope.cancel()
    await listener.aclose()


def _answering(received: list[Any], replies: dict[type[Any], Any]) -> Dispatch:
    dispatch = Dispatch()
    for kind, reply in replies.items():

        async def answer(message: Any, reply: Any = reply) -> Any:
            received.append(message)
            return reply

        dispatch.on(kind, answer)
    return dispatch


async def test_every_message_and_its_reply_round_trip(tmp_path: Path) -> None:
    received: list[Any] = []
    far = _answering(received, {kind: reply for kind, (_m, reply) in EXAMPLES.items()})
    async with channels(tmp_path, far) as near:
        for message, reply in EXAMPLES.values():
            assert await near.request(message, within=10) == reply
    assert received == [message for message, _reply in EXAMPLES.values()]


async def _raw_exchange(stream: ByteStream, frame: bytes) -> dict[str, Any]:
    await stream.send(len(frame).to_bytes(4, "big") + frame)
    header = b""
    while len(header) < 4:
        header += await stream.receive(4 - len(header))
    length = int.from_bytes(header, "big")
    data = b""
    while len(data) < length:
        data += await stream.receive(length - len(data))
    reply: dict[str, Any] = json.loads(data)
    return reply


def _frame(message: Any, request_id: int = 1) -> bytes:
    return json.dumps({"frame": "request", "id": request_id, "message": message}).encode()


@pytest.mark.parametrize(
    ("message", "found"),
    [
        ({"kind": "no_such_kind"}, "no_such_kind"),
        ({"kind": "retire"}, "episode_ids"),
        ({"kind": "retire", "episode_ids": []}, "episode_ids"),
        ({"kind": "retire", "episode_ids": [{"rollout_id": "r1"}], "extra": 1}, "extra"),
        ({"kind": "marks", "marks": {"r1": "2"}}, "marks.r1"),
        ({"kind": "register", "pid": 1, "slot": -1}, "slot"),
        ("not an object", "message"),
    ],
)
async def test_an_unknown_or_malformed_message_is_a_typed_refusal_and_the_channel_goes_on(
    tmp_path: Path, message: Any, found: str
) -> None:
    path = tmp_path / "c.sock"
    listener = await listen_private(path)
    received: list[Any] = []
    async with anyio.create_task_group() as group:
        stream = await anyio.connect_unix(path)
        far = Channel(await listener.accept(), peer="raw")
        group.start_soon(far.serve, _answering(received, {Open: None}))
        reply = await _raw_exchange(stream, _frame(message, request_id=5))
        assert reply["frame"] == "error" and reply["reply_to"] == 5
        assert reply["error"]["status"] == 422 and reply["error"]["code"] == "invalid_request"
        assert found in reply["error"]["detail"]
        await stream.send((9).to_bytes(4, "big") + b"{not json")  # unaddressable: dropped
        ok = await _raw_exchange(stream, _frame({"kind": "open"}, request_id=6))
        assert ok == {"frame": "reply", "reply_to": 6, "body": None}
        assert received == [Open()] and not far.closed.is_set()
        await stream.aclose()
        with anyio.fail_after(10):
            await far.closed.wait()  # the peer went away: the far end stops on its own
    await listener.aclose()


async def test_a_message_this_end_does_not_answer_is_refused(tmp_path: Path) -> None:
    async with channels(tmp_path, _answering([], {Open: None})) as near:
        with pytest.raises(InvalidRequestError, match="register is not answered here"):
            await near.request(Register(pid=1, slot=0), within=10)
        assert await near.request(Open(), within=10) is None


async def test_a_reply_that_is_not_what_the_message_names_is_an_internal_error(
    tmp_path: Path,
) -> None:
    far = _answering([], {Claim: "yes", Health: {"ready": True}})
    async with channels(tmp_path, far) as near:
        with pytest.raises(InternalError, match="claim"):
            await near.request(Claim(capture_key="r1"), within=10)
        with pytest.raises(InternalError, match="health"):
            await near.request(Health(), within=10)


async def test_a_refusal_keeps_its_code_across_the_channel(tmp_path: Path) -> None:
    async def refuse(message: Retire) -> None:
        raise StaleAttemptError(f"{message.episode_ids[0].capture_key} is retired")

    async with channels(tmp_path, Dispatch().on(Retire, refuse)) as near:
        with pytest.raises(StaleAttemptError, match="r1-a2 is retired") as caught:
            await near.request(Retire(episode_ids=[EPISODE]), within=10)
    assert caught.value.code == "stale_attempt"


async def test_records_cross_exactly_nan_infinities_and_big_integers_included(
    tmp_path: Path,
) -> None:
    record = {
        "episode_id": EPISODE.model_dump(),
        "floats": [float("nan"), float("inf"), float("-inf"), 0.1 + 0.2, -0.0],
        "ints": [2**200, -(2**100), 0],
        "text": 'é☃\n"quoted"',
    }
    received: list[Any] = []
    far = _answering(received, {ExportRecords: [record], Install: None})
    async with channels(tmp_path, far) as near:
        (back,) = await near.request(ExportRecords(scope=None), within=10)
        await near.request(Install(records=[record], scope=[], manifest=None), within=10)
    (install,) = [m for m in received if isinstance(m, Install)]
    for crossed in (back, install.records[0]):
        assert json.dumps(crossed) == json.dumps(record)  # NaN != NaN: compare the text


async def test_a_reply_json_cannot_carry_is_an_internal_error_and_the_channel_goes_on(
    tmp_path: Path,
) -> None:
    far = _answering([], {ShardMetrics: object(), Open: None})
    async with channels(tmp_path, far) as near:
        with pytest.raises(InternalError, match="shard_metrics cannot be written as JSON"):
            await near.request(ShardMetrics(), within=10)
        assert await near.request(Open(), within=10) is None


async def test_a_slow_answer_is_logged_with_where_its_time_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D397: a worker answered ``delete_restored`` 21 s late, and nothing said where the time
    went; an answer this slow now says how long it waited to start, in its handler, and on its
    way back."""
    monkeypatch.setattr(channel_module, "SLOW_ANSWER_SECONDS", 0.2)

    async def slow(message: Open) -> None:
        await anyio.sleep(0.3)

    async def quick(message: Close) -> Readiness:
        return READINESS

    far = Dispatch().on(Open, slow).on(Close, quick)
    async with channels(tmp_path, far) as near:
        with capture_logs() as logs:
            await near.request(Close(request=REQUEST, generation=1), within=10)
            await near.request(Open(), within=10)
    slow_answers = [e for e in logs if e["event"] == "fanout.slow_answer"]
    assert [e["kind"] for e in slow_answers] == ["open"]
    (logged,) = slow_answers
    assert logged["peer"] == "near" and logged["log_level"] == "warning"
    assert logged["handler_s"] >= 0.3 > logged["waited_to_start_s"] + logged["send_s"]
    assert logged["seconds"] >= logged["handler_s"]
