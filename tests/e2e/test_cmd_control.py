"""The operator's control commands against real control planes served on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from typer.testing import CliRunner

from coordinator import ControlClient, Coordinator, Member, read_latest
from e2e._cli.app import build_app
from e2e._servers.cluster import Cluster, ServerEntry, write_cluster
from participants import ControlPlane, Record, participant_app
from protocols import CheckpointError, EpisodeId, ParticipantKind, Phase
from tests.coordinator.deployment import TOKEN, Logged
from tests.coordinator.s3_participants import S3Shares
from tests.coordinator.test_client_end_to_end import _free_port, _serve

pytestmark = pytest.mark.anyio
R1, R2 = EpisodeId(rollout_id="r1"), EpisodeId(rollout_id="r2")
SHAPE: tuple[tuple[ParticipantKind, str, str], ...] = (
    ("environment", "environment", "environment"),
    ("model", "policy", "model"),
    ("agent", "agent", "agent"),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Served:
    cluster_file: Path
    root: Path
    fakes: dict[str, Logged]
    planes: dict[str, ControlPlane]
    urls: dict[str, str]
    log: list[tuple[str, str, str]]


@asynccontextmanager
async def served(tmp_path: Path, checkpoint_store: str | None = None) -> AsyncIterator[Served]:
    """Real control planes on 127.0.0.1 and their cluster file.

    With an ``s3://`` ``checkpoint_store``, the file names it and each participant commits to and
    restores from it (through ``S3Shares``).
    """
    log: list[tuple[str, str, str]] = []
    fakes: dict[str, Logged] = {}
    planes: dict[str, ControlPlane] = {}
    urls: dict[str, str] = {}
    async with AsyncExitStack() as stack:
        for kind, instance, _ in SHAPE:
            fake = Logged(kind, instance, log)
            fake.episodes = [R1, R2]
            plane = ControlPlane(fake)
            await stack.enter_async_context(plane.running())
            app: Any = participant_app(plane, token=TOKEN)
            if checkpoint_store is not None:
                app = S3Shares(app, tmp_path / "mirror" / instance)
            urls[instance] = await stack.enter_async_context(_serve(app))
            fakes[instance], planes[instance] = fake, plane
        root = tmp_path / "run"
        root.mkdir()
        servers = tuple(ServerEntry(i, role, urls[i]) for _, i, role in SHAPE)  # type: ignore[arg-type]
        cluster_file = tmp_path / "cluster.toml"
        write_cluster(cluster_file, Cluster(root, servers, checkpoint_store))
        yield Served(cluster_file, root, fakes, planes, urls, log)


async def cli(*args: str) -> tuple[int, Any]:
    """Run ``midflight ARGS --json`` in a worker thread (the command runs its own event loop)."""
    runner = CliRunner()
    result = await anyio.to_thread.run_sync(
        lambda: runner.invoke(
            build_app(), [*args, "--json"], env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
        )
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return result.exit_code, json.loads(lines[-1]) if lines else result.stdout


async def test_status_json_names_the_participant_blocked_in_prepare(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        agent = s.fakes["agent"]
        agent.ready_now = False
        agent.blockers = [R2.capture_key, R1.capture_key]
        client = ControlClient(s.urls["agent"], token=TOKEN, attempts=1)
        async with client, anyio.create_task_group() as group:
            group.start_soon(client.prepare, "c1", time.time() + 20)
            with anyio.fail_after(10):
                while s.planes["agent"].phase is not Phase.PREPARING:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            code, payload = await cli("status", "--cluster", str(s.cluster_file))
            agent.become_ready()
        assert code == 0
        rows = {row["server"]: row for row in payload["participants"]}
        assert set(rows) == {"environment", "policy", "agent"}
        blocked = rows["agent"]
        assert blocked["phase"] == "preparing" and blocked["checkpoint_id"] == "c1"
        assert blocked["blocker_count"] == 2
        assert blocked["blockers"] == sorted([R1.capture_key, R2.capture_key])
        assert blocked["lease_left_s"] > 0
        assert rows["policy"]["phase"] == "idle" and rows["policy"]["blocker_count"] == 0
        member = Member(
            "agent", "agent", s.urls["agent"], ControlClient(s.urls["agent"], token=TOKEN)
        )
        async with Coordinator([member]) as coordinator:
            await coordinator.resume("c1", time.time() + 10)


async def test_checkpoint_verify_restore_retire_forget_from_the_command_line(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as s:
        scope = tmp_path / "scope.json"
        scope.write_text(json.dumps([R1.capture_key]))
        cluster = ("--cluster", str(s.cluster_file))
        code, out = await cli("checkpoint", *cluster, "--scope", str(scope), "--id", "c1")
        assert code == 0 and out["published"] and out["continued"] == [R1.capture_key]
        latest = read_latest(s.root)
        assert latest is not None and latest.checkpoint_id == "c1"
        code, out = await cli("verify", out["checkpoint_dir"])
        assert code == 0 and out["problems"] == []
        code, out = await cli("restore", *cluster)
        assert code == 0 and out["checkpoint_id"] == "c1" and out["resumed"]
        assert sorted(i for i, op, _ in s.log if op == "install") == sorted(s.fakes)
        code, out = await cli("retire", *cluster, R2.capture_key)
        assert code == 0 and sorted(out["participants"]) == sorted(s.fakes)
        code, out = await cli("forget", *cluster, "r2")
        assert code == 0 and out["forgotten"] == ["r2"]
        assert [i for i, op, _ in s.log if op == "forget"] == ["environment", "agent", "policy"]
        for args, said in (
            (("forget", *cluster, "r2", "r2"), "forgot 1 rollout"),  # one rollout, named twice
            (("retire", *cluster, R2.capture_key), "retired 1 attempt"),
        ):
            result = await anyio.to_thread.run_sync(
                lambda a=args: CliRunner().invoke(
                    build_app(), list(a), env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
                )
            )
            last = result.stdout.strip().splitlines()[-1]  # the servers log in this process too
            assert result.exit_code == 0 and last == said, result.output
        code, out = await cli("retire", *cluster, "not a key!")
        assert code != 0
        for name, plane in s.planes.items():
            assert plane.phase is Phase.IDLE, name


async def test_a_blocked_checkpoint_exits_3_with_its_blockers(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        s.fakes["policy"].ready_now = False
        s.fakes["policy"].blockers = [R1.capture_key]
        code, out = await cli(
            "checkpoint", "--cluster", str(s.cluster_file), "--id", "c1", "--deadline", "0.5"
        )
        assert code == 3 and not out["published"]
        assert out["blockers"] == {"policy": [R1.capture_key]}
        assert out["blocking_episodes"] == [R1.capture_key]
        assert read_latest(s.root) is None
        for name, plane in s.planes.items():
            assert plane.phase is Phase.IDLE, name


async def test_control_commands_need_the_token(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        runner = CliRunner()
        result = await anyio.to_thread.run_sync(
            lambda: runner.invoke(
                build_app(),
                ["status", "--cluster", str(s.cluster_file)],
                env={"MIDFLIGHT_CONTROL_TOKEN": ""},
            )
        )
        assert result.exit_code == 2 and "MIDFLIGHT_CONTROL_TOKEN" in result.output


def _refuse_a_null_scope(fake: Logged, scopes: list[list[str]]) -> None:
    """Make ``fake`` export like the model participant: it needs the episodes continued."""

    async def export(episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        if episode_ids is None:
            raise CheckpointError("a model commit needs the episode_ids")
        scopes.append([e.capture_key for e in episode_ids])
        return [{"episode_id": e.model_dump()} for e in episode_ids]

    fake.export = export  # type: ignore[method-assign]


async def test_checkpoint_without_a_scope_continues_what_the_environment_exports(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as s:
        scopes: list[list[str]] = []
        _refuse_a_null_scope(s.fakes["policy"], scopes)
        cluster = ("--cluster", str(s.cluster_file))
        code, out = await cli("checkpoint", *cluster, "--id", "busy")
        assert code == 0 and out["published"], out
        assert out["continued"] == [R1.capture_key, R2.capture_key]
        assert scopes == [[R1.capture_key, R2.capture_key]]
        s.fakes["environment"].episodes = []  # an idle cluster
        code, out = await cli("checkpoint", *cluster, "--id", "idle")
        assert code == 0 and out["published"] and out["continued"] == [], out
        code, out = await cli("verify", out["checkpoint_dir"])
        assert code == 0, out


async def test_a_failed_checkpoint_leaves_no_directory_behind(tmp_path: Path) -> None:
    async with served(tmp_path) as s:

        async def broken(episode_ids: object) -> list[Record]:
            raise CheckpointError("disk full")

        s.fakes["agent"].export = broken  # type: ignore[method-assign,assignment]
        code, out = await cli("checkpoint", "--cluster", str(s.cluster_file), "--id", "c1")
        assert code == 1 and "disk full" in out["error"], out
        assert not (s.root / "checkpoints" / "c1").exists()
        assert read_latest(s.root) is None
        for name, plane in s.planes.items():
            assert plane.phase is Phase.IDLE, name


def _with_servers(s: Served, tmp_path: Path, *extra: ServerEntry) -> Path:
    """A cluster file of ``s``'s servers plus ``extra`` ones."""
    path = tmp_path / "more.toml"
    servers = tuple(ServerEntry(i, role, s.urls[i]) for _, i, role in SHAPE)  # type: ignore[arg-type]
    write_cluster(path, Cluster(root=s.root, servers=(*servers, *extra)))
    return path


async def status_output(cluster_file: Path, *extra: str) -> tuple[int, str]:
    """``midflight status`` as a person sees it on an 80-column terminal."""
    runner = CliRunner()
    result = await anyio.to_thread.run_sync(
        lambda: runner.invoke(
            build_app(),
            ["status", "--cluster", str(cluster_file), *extra],
            env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN, "COLUMNS": "80"},
        )
    )
    return result.exit_code, result.output


async def test_status_at_80_columns_keeps_names_whole_and_errors_out_of_the_counts(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as s:
        gone = ServerEntry("environment-restart", "environment", f"http://127.0.0.1:{_free_port()}")
        code, output = await status_output(_with_servers(s, tmp_path, gone))
        assert code == 0, output  # some participants answered
        assert "…" not in output, output
        lines = output.splitlines()
        note = next(i for i, line in enumerate(lines) if line.startswith("environment-restart: "))
        table = "\n".join(lines[:note])
        assert "environment-restart" in table and "unreachable" in table
        assert "policy" in table and "environment" in table
        assert "Connect" not in table  # the error is not squeezed into a column
        assert lines[note].startswith("environment-restart: ConnectError")
        assert all(len(line) <= 80 for line in output.splitlines())


async def test_status_exits_1_when_no_participant_answers(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.toml"
    dead = [
        ServerEntry(n, r, f"http://127.0.0.1:{_free_port()}")
        for n, r in (("policy", "model"), ("agent", "agent"))
    ]
    write_cluster(cluster_file, Cluster(root=tmp_path, servers=tuple(dead)))  # type: ignore[arg-type]
    code, payload = await cli("status", "--cluster", str(cluster_file))
    assert code == 1 and payload["answered"] == 0
    assert [row["server"] for row in payload["participants"]] == ["policy", "agent"]
    assert all("error" in row for row in payload["participants"])
    code, output = await status_output(cluster_file)
    assert code == 1 and "no participant answered" in output


async def test_status_shows_a_server_without_control_routes(tmp_path: Path) -> None:
    async with served(tmp_path) as s, AsyncExitStack() as stack:
        plane = ControlPlane(Logged("resources", "resources", s.log))
        await stack.enter_async_context(plane.running())
        url = await stack.enter_async_context(_serve(participant_app(plane, token=None)))
        cluster_file = _with_servers(s, tmp_path, ServerEntry("resources", "resources", url))
        code, payload = await cli("status", "--cluster", str(cluster_file))
        assert code == 0
        rows = {row["server"]: row for row in payload["participants"]}
        assert rows["resources"]["control_routes"] == "disabled"
        assert rows["policy"]["phase"] == "idle"
        code, output = await status_output(cluster_file)
        assert "resources: control routes disabled" in output


async def test_status_watch_json_prints_one_object_per_line_per_refresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("e2e._cli.control.time", SimpleNamespace(sleep=sleep, time=time.time))
    async with served(tmp_path) as s:
        runner = CliRunner()
        result = await anyio.to_thread.run_sync(
            lambda: runner.invoke(
                build_app(),
                ["status", "--cluster", str(s.cluster_file), "--watch", "0.5", "--json"],
                env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN},
            )
        )
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(objects) == 3 and sleeps == [0.5, 0.5, 0.5]
    assert all(len(o["participants"]) == 3 and o["answered"] == 3 for o in objects)


async def test_resume_of_an_id_nobody_holds_says_nothing_was_resumed(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        cluster = ("--cluster", str(s.cluster_file))
        code, out = await cli("resume", *cluster, "--id", "nope")
        assert code == 0 and out["resumed"] == [] and sorted(out["not_open"]) == sorted(s.fakes)
        runner = CliRunner()
        result = await anyio.to_thread.run_sync(
            lambda: runner.invoke(
                build_app(),
                ["resume", *cluster, "--id", "nope"],
                env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN},
            )
        )
        assert "nothing to resume" in result.output and "resumed nope on" not in result.output
        async with ControlClient(s.urls["agent"], token=TOKEN, attempts=1) as client:
            await client.prepare("c1", time.time() + 20)  # open on the agent only
        code, out = await cli("resume", *cluster, "--id", "c1")
        assert code == 0 and out["resumed"] == ["agent"]
        assert sorted(out["not_open"]) == ["environment", "policy"]
        assert s.planes["agent"].phase is Phase.IDLE


async def test_the_control_commands_name_a_server_without_control_routes(tmp_path: Path) -> None:
    async with served(tmp_path) as s, AsyncExitStack() as stack:
        plane = ControlPlane(Logged("resources", "resources", s.log))
        await stack.enter_async_context(plane.running())
        url = await stack.enter_async_context(_serve(participant_app(plane, token=None)))
        cluster_file = _with_servers(s, tmp_path, ServerEntry("resources", "resources", url))
        runner = CliRunner()
        env = {"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
        args = ["checkpoint", "--cluster", str(cluster_file), "--id", "c1", "--json"]
        result = await anyio.to_thread.run_sync(lambda: runner.invoke(build_app(), args, env=env))
        assert result.exit_code == 0, result.output
        assert "warning: resources: control routes disabled" in result.stderr
        # with the policy server's routes off too, the refusal names both
        only = tmp_path / "disabled.toml"
        servers = (ServerEntry("policy", "model", url), ServerEntry("resources", "resources", url))
        write_cluster(only, Cluster(root=s.root, servers=servers))
        code, out = await cli("checkpoint", "--cluster", str(only), "--id", "c2")
        assert code == 1 and "control routes disabled on policy, resources" in out["error"], out


async def test_bad_arguments_of_the_control_commands_are_one_line_usage_errors(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as s:
        cluster = ("--cluster", str(s.cluster_file))
        bad_scope = tmp_path / "scope.json"
        bad_scope.write_text('{"not": "a list"}')
        cases = [
            ("retire", *cluster, "not a key!"),
            ("checkpoint", *cluster, "--scope", str(tmp_path / "missing.json")),
            ("checkpoint", *cluster, "--scope", str(bad_scope)),
            ("restore", *cluster),  # nothing published yet
        ]
        runner = CliRunner()
        for args in cases:
            result = await anyio.to_thread.run_sync(
                lambda args=args: runner.invoke(
                    build_app(), list(args), env={"MIDFLIGHT_CONTROL_TOKEN": TOKEN}
                )
            )
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert result.exit_code == 2 and len(lines) == 1, (args, result.stderr)
            assert lines[0].startswith("error: "), lines


async def test_status_counts_restore_fences_apart_from_retire_marks(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        cluster = ("--cluster", str(s.cluster_file))
        scope = tmp_path / "scope.json"
        scope.write_text(json.dumps([R1.capture_key]))
        code, _ = await cli("checkpoint", *cluster, "--scope", str(scope), "--id", "c1")
        assert code == 0
        code, _ = await cli("restore", *cluster)
        assert code == 0
        code, payload = await cli("status", *cluster)
        rows = {row["server"]: row for row in payload["participants"]}
        assert rows["policy"]["restore_fences"] == 1 and rows["policy"]["retired_rollouts"] == 0
        code, output = await status_output(s.cluster_file)
        assert "fenced=1" in output and "retired=" not in output
