"""The drill controller's commit scope and what it accepts.

Attempts in flight, and restored attempts it still owes, are in every commit scope; a result of an
attempt the controller retired meanwhile is dropped (D227).

A restored attempt whose ``/run`` has not started yet must still be named in every commit (by its
replacement attempt), or the commit deletes its restored state (control-plane §5, step 5) and the
attempt then runs from its input again, repeating model calls. D192.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from coordinator import PrepareResult
from e2e._drill.driver import Driver
from e2e._drill.plan import DriverPlan
from e2e._drill.store import ModelShareFigures
from e2e._servers.cluster import default_cluster
from e2e._servers.evidence import read_evidence
from protocols import EpisodeId, Phase, PrepareReply, PrepareReport

pytestmark = pytest.mark.anyio


class _Commit:
    def __init__(self, episodes: list[EpisodeId]) -> None:
        self.episodes = episodes

    def generation_cut_episodes(self) -> list[str]:
        return []

    def environment_episode_ids(self) -> list[str]:
        return [episode.capture_key for episode in self.episodes]


class _Control:
    """Stands in for the control session: records the commit scope, answers like a cluster."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.scopes: list[list[str]] = []

    def checkpoint_dir(self, root: Path, checkpoint_id: str) -> Path:
        return root / "checkpoints" / checkpoint_id

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareResult:
        return PrepareResult(prepared=True, replies={})

    async def commit(self, *args: Any) -> _Commit:
        episodes: list[EpisodeId] = list(args[-1])
        self.scopes.append([episode.capture_key for episode in episodes])
        return _Commit(episodes)

    async def publish(self, *args: Any) -> None:
        return None

    async def resume(self, *args: Any) -> None:
        return None

    async def coordinator(self) -> None:
        return None  # the real session discovers the participants here, once


async def test_a_commit_names_restored_attempts_that_have_not_started(tmp_path: Path) -> None:
    plan = DriverPlan(
        rollouts=["r1", "r2"],
        task_input={},
        phase=1,
        checkpoints=1,
        crash_after=False,
        commit_delay_s=0.0,
    )
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    control = _Control(tmp_path)
    driver.control = control  # type: ignore[assignment]
    try:
        driver.owed = {"r1": 1}  # restored as r1-a1; its /run is not sent yet
        driver.in_flight = {"r2": 0}
        assert await driver.checkpoint(0)
        assert control.scopes == [["r1-a1", "r2"]]
        assert driver.admission.is_open  # its resume reopened what its prepare closed (D402)
    finally:
        await driver.http.aclose()


class _Ledger:
    """The control session's ledger reads: a manifest per capture key, ``None`` once retired."""

    def __init__(self, manifests: dict[str, dict[str, Any] | None]) -> None:
        self.manifests = manifests

    async def ledger_manifest(self, capture_key: str) -> dict[str, Any] | None:
        return self.manifests.get(capture_key, {"records": []})


def _driver_with_environment(
    tmp_path: Path, on_run: Any, manifests: dict[str, dict[str, Any] | None]
) -> Driver:
    plan = DriverPlan(rollouts=["r1"], task_input={}, phase=0, checkpoints=0, crash_after=False)
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    driver.control = _Ledger(manifests)  # type: ignore[assignment]
    driver.http = httpx.AsyncClient(transport=httpx.MockTransport(on_run))
    return driver


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    return read_evidence(tmp_path / "evidence" / "driver.jsonl")


async def test_a_result_of_an_attempt_retired_while_its_reply_was_on_the_wire_is_dropped(
    tmp_path: Path,
) -> None:
    # A retire waits for an episode in its final clean-up and lets its result through: the
    # controller that retired the attempt must not accept it (its ledger goes with the retire).
    driver: Driver

    def on_run(request: httpx.Request) -> httpx.Response:
        attempt = json.loads(request.content)["episode_id"]["attempt"]
        if attempt == 0:
            driver.retired["r1"] = 0  # the retire was sent while this reply was on the wire
        return httpx.Response(200, json={"result": {"reward": 0.5}})

    driver = _driver_with_environment(tmp_path, on_run, {})
    try:
        await driver.run_rollout("r1", 0)
    finally:
        await driver.http.aclose()
    assert driver.state.accepted == {"r1": {"attempt": 1, "reward": 0.5}}
    kinds = [(e["event"], e.get("attempt")) for e in _events(tmp_path)]
    assert kinds == [("dispatch", 0), ("run_discarded", 0), ("dispatch", 1), ("result", 1)]


async def test_a_result_whose_ledger_was_retired_is_dropped_not_a_crash(tmp_path: Path) -> None:
    def on_run(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"result": {"reward": 0.5}})

    driver = _driver_with_environment(tmp_path, on_run, {"r1": None})  # 410 for r1's ledger
    try:
        await driver.run_attempt("r1", 0)
    finally:
        await driver.http.aclose()
    assert driver.state.accepted == {}
    assert [e["event"] for e in _events(tmp_path)] == ["dispatch", "run_discarded"]


async def test_an_attempt_whose_result_is_being_accepted_is_not_retirable(tmp_path: Path) -> None:
    plan = DriverPlan(
        rollouts=["r1", "r2"], task_input={}, phase=0, checkpoints=0, crash_after=False
    )
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    try:
        driver.in_flight = {"r1": 0, "r2": 3}
        driver.owed = {"r3": 1}
        driver.settling = {"r2": 3}
        assert driver.retirable() == [("r1", 0), ("r3", 1)]
    finally:
        await driver.http.aclose()


class _CutControl(_Control):
    """Also commits a directory, carries cuts as told, and counts publications and resumes."""

    def __init__(
        self,
        root: Path,
        cuts: list[list[str]],
        cut_at_prepare: int = 1,
        delivered: list[int] | None = None,
        cut_tokens: list[int] | None = None,
    ) -> None:
        super().__init__(root)
        self.cuts = cuts
        self.saved = cut_tokens  # tokens each commit's cuts saved (8 by default)
        self.cut_at_prepare = cut_at_prepare  # the model server's "cut" count in its prepare reply
        self.delivered = delivered  # delivered calls each commit records (one each by default)
        self.published: list[str] = []
        self.resumed: list[str] = []

    async def prepare(self, checkpoint_id: str, deadline: float) -> PrepareResult:
        report = PrepareReport(ready=True, counts={"cut": self.cut_at_prepare})
        return PrepareResult(
            prepared=True, replies={"model": PrepareReply(phase=Phase.PREPARED, report=report)}
        )

    async def commit(self, *args: Any) -> _Commit:
        checkpoint_id, directory = args[0], args[2]
        (directory / "gym").mkdir(parents=True)  # what the participants would have written
        commit = await super().commit(*args)
        cuts = self.cuts.pop(0)
        commit.generation_cut_episodes = lambda: cuts  # type: ignore[method-assign]
        assert checkpoint_id
        return commit

    async def share_figures(self, checkpoint_dir: Path) -> ModelShareFigures:
        assert (checkpoint_dir / "gym").is_dir()  # read after the commit, before publication
        return ModelShareFigures(
            cut_tokens=self.saved.pop(0) if self.saved is not None else 8,
            delivered_calls=self.delivered.pop(0) if self.delivered is not None else 1,
        )

    async def publish(self, *args: Any) -> None:
        self.published.append(args[1])

    async def resume(self, *args: Any) -> None:
        self.resumed.append(args[0])


def _crash_phase_driver(tmp_path: Path, control: _CutControl) -> Driver:
    """The controller of a phase that ends in a crash, with one checkpoint to take, on ``control``."""
    plan = DriverPlan(
        rollouts=["r1"], task_input={}, phase=0, checkpoints=1, crash_after=True, commit_delay_s=0
    )
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    driver.control = control  # type: ignore[assignment]
    return driver


async def test_a_commit_without_a_cut_is_abandoned_unpublished_when_the_crash_needs_one(
    tmp_path: Path,
) -> None:
    control = _CutControl(tmp_path, cuts=[[], ["r1"], []])
    driver = _crash_phase_driver(tmp_path, control)
    try:
        driver.in_flight = {"r1": 0}
        assert not await driver.checkpoint(0, for_crash=True)  # no cut: not published
        assert control.published == [] and control.resumed == ["ckpt-0-0"]
        assert not (tmp_path / "checkpoints" / "ckpt-0-0").exists()
        assert driver.abandoned == 1
        assert await driver.checkpoint(1, for_crash=True)  # a cut: published
        assert control.published == ["ckpt-0-1"]
        assert await driver.checkpoint(2)  # no cut needed: published as it is
        assert control.published == ["ckpt-0-1", "ckpt-0-2"] and driver.abandoned == 1
        events = [json.loads(line) for line in driver.evidence.path.read_text().splitlines()]
        assert [e["id"] for e in events if e["event"] == "checkpoint_abandoned"] == ["ckpt-0-0"]
    finally:
        await driver.http.aclose()


async def test_a_commit_whose_cut_saved_no_token_is_abandoned_when_the_crash_needs_one(
    tmp_path: Path,
) -> None:
    # D404: a cut taken before its generation produced a token continues nothing after the
    # restore, so the drill's ignore-cuts fault then wasted nothing and went unseen.
    control = _CutControl(tmp_path, cuts=[["r1"], ["r1"]], cut_tokens=[0, 5])
    driver = _crash_phase_driver(tmp_path, control)
    try:
        driver.in_flight = {"r1": 0}
        assert not await driver.checkpoint(0, for_crash=True)
        assert await driver.checkpoint(1, for_crash=True)
        assert control.published == ["ckpt-0-1"] and driver.abandoned == 1
    finally:
        await driver.http.aclose()


async def test_a_commit_that_exported_nothing_is_published_even_without_a_cut(
    tmp_path: Path,
) -> None:
    # Every rollout a restart (restart-only resources): nothing can carry a cut, so waiting for one
    # would abandon every commit and leave the crash with nothing to restore (D247).
    control = _CutControl(tmp_path, cuts=[[]])
    driver = _crash_phase_driver(tmp_path, control)
    try:
        driver.in_flight = {}
        assert await driver.checkpoint(0, for_crash=True)
        assert control.published == ["ckpt-0-0"] and driver.abandoned == 0
    finally:
        await driver.http.aclose()


async def test_a_commit_that_needs_a_cut_is_not_made_when_prepare_cut_nothing(
    tmp_path: Path,
) -> None:
    # On a loaded machine the generations can all finish before the model server closes its
    # admission: its prepare cuts none, and a commit then would only be written to be abandoned.
    control = _CutControl(tmp_path, cuts=[[], ["r1"]], cut_at_prepare=0)
    driver = _crash_phase_driver(tmp_path, control)
    try:
        driver.in_flight = {"r1": 0}
        assert not await driver.checkpoint(0, for_crash=True)
        assert control.scopes == [] and control.resumed == ["ckpt-0-0"] and driver.abandoned == 1
        assert await driver.checkpoint(1)  # no cut needed: committed and published regardless
        control.cut_at_prepare = 1  # a generation cut at prepare: committed, with its cut
        assert await driver.checkpoint(2, for_crash=True)
        assert control.scopes == [["r1"], ["r1"]] and control.published == ["ckpt-0-1", "ckpt-0-2"]
    finally:
        await driver.http.aclose()


async def test_a_commit_with_a_cut_but_no_delivered_call_is_abandoned_when_a_crash_restores_it(
    tmp_path: Path,
) -> None:
    # Taken while every rollout waits on its first call, a commit carries cuts and no delivered
    # call: a restore of it cannot show that no delivered call ran again (the rerun-from-input
    # fault then trips nothing), so the crash's checkpoint is taken again (D360).
    control = _CutControl(tmp_path, cuts=[["r1"], ["r1"], ["r1"]], delivered=[0, 2])
    driver = _crash_phase_driver(tmp_path, control)
    try:
        driver.in_flight = {"r1": 0}
        assert not await driver.checkpoint(0, for_crash=True)
        assert control.published == [] and control.resumed == ["ckpt-0-0"]
        assert not (tmp_path / "checkpoints" / "ckpt-0-0").exists()
        assert await driver.checkpoint(1)  # not the crash's: published as it is
        assert await driver.checkpoint(2, for_crash=True)
        assert control.published == ["ckpt-0-1", "ckpt-0-2"] and driver.abandoned == 1
        events = [json.loads(line) for line in driver.evidence.path.read_text().splitlines()]
        abandoned = [(e["id"], e["why"]) for e in events if e["event"] == "checkpoint_abandoned"]
        assert abandoned == [("ckpt-0-0", "no delivered call")]
    finally:
        await driver.http.aclose()


async def test_a_refused_run_is_sent_again_after_pauses_that_grow(tmp_path: Path) -> None:
    # D372: a fixed 50 ms made thousands of refused rollouts a flood at one environment.
    import time

    sent: list[float] = []

    def on_run(request: httpx.Request) -> httpx.Response:
        sent.append(time.monotonic())
        if len(sent) <= 5:
            return httpx.Response(409, json={"error": {"code": "admission_closed", "detail": ""}})
        return httpx.Response(200, json={"failure": {"code": "x", "detail": "ended"}})

    driver = _driver_with_environment(tmp_path, on_run, {})
    try:
        await driver.run_attempt("r1", 0)
    finally:
        await driver.http.aclose()
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    assert len(gaps) == 5
    assert gaps[0] < 0.2 and gaps[4] >= 0.4, (
        gaps
    )  # 50 ms times 0.5 to 1.5, then 800 ms times 0.5 to 1.5
    assert [e["event"] for e in _events(tmp_path)] == ["dispatch", "run_failed"]


async def test_a_run_refused_while_this_controller_holds_admission_closed_waits_for_its_resume(
    tmp_path: Path,
) -> None:
    # D402: thousands of refused rollouts re-sent every second for as long as the controller's
    # own checkpoint lasted saturated the controller, whose checkpoint then waited on them.
    sent: list[str] = []

    def on_run(request: httpx.Request) -> httpx.Response:
        sent.append("run")
        if len(sent) == 1:
            return httpx.Response(409, json={"error": {"code": "admission_closed", "detail": ""}})
        return httpx.Response(200, json={"failure": {"code": "x", "detail": "ended"}})

    driver = _driver_with_environment(tmp_path, on_run, {})
    driver.admission.close()  # as the controller's prepare does
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(driver.run_attempt, "r1", 0)
            await anyio.sleep(1.0)  # the pauses of D372 would have sent it four times by now
            assert sent == ["run"]
            driver.admission.open()  # as the controller's resume does
            with anyio.fail_after(10):
                await driver.done_events["r1"].wait()
    finally:
        await driver.http.aclose()
    assert sent == ["run", "run"]
    assert [e["event"] for e in _events(tmp_path)] == ["dispatch", "run_failed"]


async def test_replies_on_the_wire_are_waited_for_all_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # D402: one after another, each with its own 30 s, the waits held a checkpoint for minutes.
    monkeypatch.setattr("e2e._drill.driver.DEADLINE_SECONDS", 0.5)
    plan = DriverPlan(rollouts=["r1"], task_input={}, phase=0, checkpoints=0, crash_after=False)
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    rollouts = [f"r{n}" for n in range(40)]  # none ends: each wait runs out its own deadline
    for rollout in rollouts:
        driver.done_events[rollout] = anyio.Event()
        driver.refused_events[rollout] = anyio.Event()
    driver.done_events["r7"].set()
    try:
        with anyio.fail_after(5):  # one after another: 40 x 0.5 s
            await driver._wait_on_the_wire(rollouts)
    finally:
        await driver.http.aclose()


async def test_a_run_whose_connection_was_never_made_is_sent_again(tmp_path: Path) -> None:
    # D372: a /run that never reached the environment runs nowhere, so the same attempt goes
    # again; the controller died of httpx.ConnectTimeout at 2,000 rollouts in flight.
    import asyncio
    import socket

    with socket.socket() as probe:  # a port with nothing listening on it, for now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        body = b'{"failure": {"code": "x", "detail": "ended"}}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    plan = DriverPlan(rollouts=["r1"], task_input={}, phase=0, checkpoints=0, crash_after=False)
    driver = Driver(tmp_path, default_cluster(tmp_path), plan, "token")
    driver.environment_url = lambda rollout: f"http://127.0.0.1:{port}"  # type: ignore[method-assign]
    server: asyncio.Server | None = None
    try:
        attempt = asyncio.ensure_future(driver.run_attempt("r1", 0))
        await asyncio.sleep(0.4)  # refused connections meanwhile, each sent again
        assert not attempt.done()
        server = await asyncio.start_server(answer, "127.0.0.1", port)
        await asyncio.wait_for(attempt, 10)
    finally:
        await driver.http.aclose()
        if server is not None:
            server.close()
            await server.wait_closed()
    assert [e["event"] for e in _events(tmp_path)] == ["dispatch", "run_failed"]


async def test_a_phase_whose_rollouts_all_finished_still_publishes_a_checkpoint_for_its_crash(
    tmp_path: Path,
) -> None:
    """D383: with 2,000 rollouts at once, every commit of a phase was abandoned for want of a cut
    until the rollouts had all finished; the phase crashed with nothing published, and the next
    phase's controller died of ``FileNotFoundError: no published checkpoint``."""
    control = _CutControl(tmp_path, cuts=[[]])
    driver = _crash_phase_driver(tmp_path, control)
    driver.state.accepted["r1"] = {"attempt": 0}  # finished before any checkpoint was taken
    crashed, said = await _run_to_the_crash_point(driver)
    assert crashed
    assert control.published == ["ckpt-0-0"]
    assert said[-1] == "crash-point"


class _CrashPoint(Exception):
    """Where the phase would wait for its SIGKILL."""


async def _run_to_the_crash_point(driver: Driver) -> tuple[bool, list[str]]:
    """Run the phase until it says ``crash-point``; whether it got there, and what it said."""
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line == "crash-point":
            raise _CrashPoint

    driver.say = say  # type: ignore[method-assign]
    crashed = False
    try:
        with anyio.fail_after(20):
            await driver.run()
    except* _CrashPoint:
        crashed = True
    finally:
        await driver.http.aclose()
    return crashed, said


def _crashing_phase(tmp_path: Path, rollouts: int, **plan: Any) -> tuple[Driver, _CutControl]:
    """Phase 0 of ``rollouts`` with one checkpoint before its crash, cutting ``r0``, and a model
    call in flight from the start; ``plan`` adds to the driver's plan."""
    driver = Driver(
        tmp_path,
        default_cluster(tmp_path),
        DriverPlan(
            rollouts=[f"r{n}" for n in range(rollouts)],
            task_input={},
            phase=0,
            checkpoints=1,
            crash_after=True,
            commit_delay_s=0,
            **plan,
        ),
        "token",
    )
    control = _CutControl(tmp_path, cuts=[["r0"]])

    async def generating() -> int:
        return 1

    control.model_calls_in_flight = generating  # type: ignore[attr-defined]
    driver.control = control  # type: ignore[assignment]
    return driver, control


async def test_a_phase_checkpoints_only_once_its_dispatcher_has_filled(tmp_path: Path) -> None:
    """D403: a drill of 4,000 at once took its checkpoints 2-3 s into each phase, with a few
    hundred rollouts sent, so its crashes restored under 200 rollouts, not thousands."""
    release = anyio.Event()

    async def on_run(request: httpx.Request) -> httpx.Response:
        await release.wait()  # every run stays in flight
        return httpx.Response(200, json={"failure": {"code": "x", "detail": "ended"}})

    driver, control = _crashing_phase(tmp_path, 40, concurrency=30)
    in_flight_at_prepare: list[int] = []
    prepare = control.prepare

    async def counting_prepare(checkpoint_id: str, deadline: float) -> PrepareResult:
        in_flight_at_prepare.append(len(driver.in_flight))
        return await prepare(checkpoint_id, deadline)

    control.prepare = counting_prepare  # type: ignore[method-assign]
    driver.http = httpx.AsyncClient(transport=httpx.MockTransport(on_run))
    crashed, _said = await _run_to_the_crash_point(driver)
    assert crashed
    assert in_flight_at_prepare == [30]


async def test_a_phase_discovers_its_participants_before_it_dispatches(tmp_path: Path) -> None:
    """D408: run 22 of the 4,000 drill discovered its participants on its first prepare, with
    4,000 rollouts in flight; the status calls took about 25 s of the prepare's 30 s deadline,
    and the environment's prepare, sent with 5 s left, got no reply in time."""
    driver, control = _crashing_phase(tmp_path, 4)
    seen: list[str] = []

    async def discover() -> None:
        seen.append(f"discovered with {len(driver.in_flight)} in flight")

    async def prepare(checkpoint_id: str, deadline: float) -> PrepareResult:
        seen.append("prepare")
        return await _CutControl.prepare(control, checkpoint_id, deadline)

    control.coordinator = discover  # type: ignore[method-assign]
    control.prepare = prepare  # type: ignore[method-assign]
    driver.http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: httpx.Response(503))
    )
    crashed, _said = await _run_to_the_crash_point(driver)
    assert crashed
    assert seen[:2] == ["discovered with 0 in flight", "prepare"], seen
