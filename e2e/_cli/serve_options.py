"""What every ``midflight serve <role>`` shares: its option types and how they are resolved.

A cluster file the server cannot use, a run root that cannot be a directory and a malformed
``--checkpoint-root`` are usage errors here, one line and exit 2, before any server is built.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from protocols import is_object_store_url, open_store

from .._servers.context import ServeContext, serve_options_from
from .output import usage_error


def serve_options(**shared: Any) -> ServeContext:
    """``serve_options_from``, with a run root that exists as a directory.

    A cluster file it cannot use (D363), or a run root that is a file or cannot be made, is a
    usage error rather than a traceback from whichever server first writes under it.
    """
    try:
        options = serve_options_from(**shared)
    except ValueError as exc:
        usage_error(str(exc))
    if options.root.exists() and not options.root.is_dir():
        usage_error(f"run root {options.root} is not a directory")
    try:
        options.root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        usage_error(f"run root {options.root}: {exc.strerror or exc}")
    return options


class ServeOptions:
    """Option types every role shares."""

    Cluster = Annotated[
        Path | None,
        typer.Option("--cluster", help="Cluster file (TOML): the run root and the peers' URLs."),
    ]
    Root = Annotated[
        Path | None,
        typer.Option("--root", help="Run root; default: the cluster file's, else ./midflight-run."),
    ]
    CheckpointRoot = Annotated[
        str | None,
        typer.Option(
            "--checkpoint-root",
            metavar="DIR|s3://BUCKET/PREFIX",
            help="Commit and restore only checkpoints under DIR, or under an s3:// prefix "
            "(endpoint and credentials from AWS_*); default: the run root.",
        ),
    ]
    TraceDir = Annotated[
        Path | None,
        typer.Option(
            "--trace-dir",
            help="Append this server's spans to DIR as JSON lines (midflight trace DIR draws "
            "them); OTEL_* variables send them to a collector too.",
        ),
    ]
    Processes = Annotated[
        int,
        typer.Option(
            "--processes",
            "--workers",
            min=1,
            max=64,
            help="Processes behind one port, each serving a shard of the rollouts; still one "
            "participant (1: one process). --workers is the same option.",
        ),
    ]


def checkpoint_root_option(value: str | None) -> Path | str | None:
    """``--checkpoint-root``: a directory, or an ``s3://`` URL in its canonical form (D330).

    Raises:
        typer.Exit: A malformed ``s3://`` URL, or S3 support is not installed (a usage error).
    """
    if value is None:
        return None
    if not is_object_store_url(value):
        return Path(value)
    try:
        return open_store(value).url
    except ValueError as exc:
        usage_error(f"--checkpoint-root {value!r}: {exc}")


class ModeChoice(StrEnum):
    """``--mode``: how sessions survive a checkpoint."""

    exported = "exported"
    stateless = "stateless"
    restart_only = "restart_only"


class LedgerLayoutChoice(StrEnum):
    """``--ledger-layout``: the capture ledger's on-disk layout (D340)."""

    sqlite = "sqlite"
    file = "file"


class VerifyChoice(StrEnum):
    """``--verify``: whether a checkpoint waits for verify or lets it be re-run."""

    wait = "wait"
    replay = "replay"
