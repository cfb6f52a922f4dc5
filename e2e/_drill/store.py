"""Where a drill keeps its checkpoints: the run directory, or S3 (``--checkpoint-store``).

``disk`` (the default) keeps them under each run's own directory, as always. ``s3`` starts a local
S3 API server (moto's, on 127.0.0.1) for the drill's lifetime and keeps each run's checkpoints
under its own prefix there; ``s3://bucket/prefix`` uses that store with the caller's ``AWS_*``
environment. Every server and every controller incarnation of a run gets the same root and the
same ``AWS_*`` variables, so all of them write and read the same objects. Only checkpoints move:
evidence, the staging store and the capture ledger stay in the run directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from participants import read_participant_checkpoint
from protocols import EpisodeId, is_object_store_url, open_store, split_s3_url

from .._launch.object_store import LocalS3

DISK: Final = "disk"
LOCAL_S3: Final = "s3"
AWS_VARIABLES: Final = (
    "AWS_ENDPOINT_URL",
    "AWS_ALLOW_HTTP",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)


def local_s3_available() -> bool:
    """Whether a local S3 server can start here (moto and obstore are installed)."""
    return all(importlib.util.find_spec(name) is not None for name in ("moto", "obstore"))


def check_store_option(value: str) -> str:
    """``disk``, ``s3`` or an ``s3://bucket[/prefix]`` URL.

    Raises:
        ValueError: Anything else, or a malformed URL.
    """
    if value in (DISK, LOCAL_S3):
        return value
    if is_object_store_url(value):
        split_s3_url(value)
        return value.rstrip("/")
    raise ValueError(f"{value!r}: use disk, s3 (a local S3 server) or s3://bucket/prefix")


@dataclass
class DrillStore:
    """The checkpoint root of each run of a drill, and what its processes need to reach it.

    Attributes:
        base: ``""`` for the run directories, else the ``s3://`` URL the runs' prefixes go under.
        env: The ``AWS_*`` variables every process of a run gets.
        local: The local S3 server, when the drill started one.
    """

    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    local: LocalS3 | None = None

    def root_of(self, run: Path) -> str:
        """Where the run in directory ``run`` keeps its checkpoints (``""``: in ``run``)."""
        return f"{self.base}/{run.name}" if self.base else ""

    def location(self, run: Path) -> Path | str:
        """The checkpoint root as the coordinator takes it: ``run`` itself, or the URL."""
        return self.root_of(run) or run

    def object_count(self, run: Path) -> int:
        """Objects (files, on disk) the run's checkpoints are made of, partial ones included."""
        return len(open_store(self.location(run)).list_objects("checkpoints"))


def model_shares(checkpoint_dir: Path | str) -> list[str]:
    """The model servers' published shares of a checkpoint (a share without its manifest is a
    partial commit and left out)."""
    store = open_store(checkpoint_dir)
    return [
        store.describe(f"gym/model/{instance}")
        for instance in store.subdirectories("gym/model")
        if store.exists(f"gym/model/{instance}/manifest.json")
    ]


def model_records(checkpoint_dir: Path | str) -> Iterator[dict[str, Any]]:
    """Every record of a checkpoint's published model shares. Blocking: run it in a thread."""
    for location in model_shares(checkpoint_dir):
        share = read_participant_checkpoint(
            location, kind="model", instance=str(location).rsplit("/", 1)[-1]
        )
        yield from share.records


def delivered_rows(checkpoint_dir: Path | str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(rollout, row) for each call a checkpoint's model shares record as delivered.

    A model record's rows are its episode's delivered calls: the calls still undelivered at the
    commit were left out of the export. Blocking: run it in a worker thread.
    """
    for record in model_records(checkpoint_dir):
        rollout = EpisodeId.model_validate(record["episode_id"]).rollout_id
        for row in record.get("rows", []):
            yield rollout, row


@dataclass(frozen=True)
class ModelShareFigures:
    """What a committed checkpoint's model shares hold, read in one pass (D404)."""

    cut_tokens: int
    """Tokens its generation cuts saved (their prefixes, summed). A cut taken before its
    generation produced a token saves nothing, so a restore of it shows nothing continued."""
    delivered_calls: int
    """Calls its model records record as delivered."""


def model_share_figures(checkpoint_dir: Path | str) -> ModelShareFigures:
    """Both figures of a checkpoint's model shares, each share read once. Blocking: run it in a
    worker thread.

    Raises:
        pydantic.ValidationError: A record names no valid episode, as ``delivered_rows`` does.
    """
    cut_tokens = delivered = 0
    for record in model_records(checkpoint_dir):
        EpisodeId.model_validate(record["episode_id"])
        delivered += len(record.get("rows", []))
        cut_tokens += sum(
            int(cut.get("continuation", {}).get("prefix_token_count", 0))
            for cut in record.get("generation_cuts", [])
        )
    return ModelShareFigures(cut_tokens=cut_tokens, delivered_calls=delivered)


def published_checkpoints(checkpoints_at: Path | str) -> list[str]:
    """The ids of the checkpoints published under a run's checkpoint root, sorted."""
    store = open_store(checkpoints_at)
    return [
        name
        for name in store.subdirectories("checkpoints")
        if store.exists(f"checkpoints/{name}/checkpoint.json")
    ]


@contextlib.contextmanager
def drill_store(option: str) -> Iterator[DrillStore]:
    """The store ``--checkpoint-store`` names, started (a local S3 server) for the block."""
    if option == DISK:
        yield DrillStore()
        return
    run_prefix = f"drill-{secrets.token_hex(4)}"
    if option == LOCAL_S3:
        with LocalS3() as local:
            env = local.environment()
            with _environment(env):  # this process reads the runs' checkpoints too
                yield DrillStore(local.url(run_prefix), env, local)
        return
    env = {name: os.environ[name] for name in AWS_VARIABLES if name in os.environ}
    yield DrillStore(f"{option}/{run_prefix}", env)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
