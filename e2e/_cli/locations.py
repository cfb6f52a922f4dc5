"""What ``verify``, ``gc`` and ``pin`` are given: a directory or an ``s3://`` URL, checked first.

A location that cannot be what the command needs (a malformed URL, a run root where a checkpoint
is asked for, a prefix with nothing under it) is a usage error: one line, exit 2, before any
work. A store that fails while the command works (the network, credentials) is one line and
exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.markup import escape

from coordinator import CHECKPOINT_FILE, CHECKPOINTS_SUBDIR, LATEST_FILE
from protocols import CheckpointStore, is_object_store_url, open_store

from .output import error_console, usage_error

SHARES_SUBDIR = "gym"
"""Where participants commit their shares inside a checkpoint directory."""
EXIT_STORE_FAILED = 1


def as_location(text: str) -> str | Path:
    """The command-line argument as a location: an ``s3://`` URL stays a string."""
    return text.rstrip("/") if is_object_store_url(text) else Path(text)


def store_failed(exc: OSError) -> NoReturn:
    """Print the store's failure as one ``error:`` line on stderr and exit 1.

    Raises:
        typer.Exit: Always, with exit code 1.
    """
    error_console.print(f"[red]error[/red]: {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(EXIT_STORE_FAILED)


def _open(url: str) -> CheckpointStore:
    try:
        return open_store(url)
    except ValueError as exc:
        usage_error(str(exc))


def _naming(url: str, exc: OSError) -> str:
    """The store's failure as one line that names ``url`` once (the store's own text may)."""
    said = str(exc)
    return said if said.startswith(url) else f"{url}: {said}"


def _parent(url: str) -> str:
    return url.rsplit("/", 1)[0]


def _latest_hint(store: CheckpointStore, checkpoints: str) -> str:
    """Where the newest checkpoint under ``checkpoints`` (a key, ``""`` for the root) is."""
    pointer = f"{checkpoints}/{LATEST_FILE}" if checkpoints else LATEST_FILE
    current = store.read_versioned(pointer)
    latest = "" if current is None else current[0].decode("utf-8", "replace").strip()
    if not latest:
        return "nothing is published there yet"
    return f"LATEST is {store.describe(f'{checkpoints}/{latest}' if checkpoints else latest)}"


def check_store_checkpoint(url: str) -> CheckpointStore:
    """The store rooted at the checkpoint ``url``; a usage error when it names no checkpoint.

    A prefix holding shares but no ``checkpoint.json`` is a partial commit: a bad checkpoint,
    left to verify (exit 1).

    Raises:
        typer.Exit: With exit code 2, after one line naming what ``url`` is instead.
    """
    store = _open(url)
    try:
        names = store.subdirectories("")
        if store.exists(CHECKPOINT_FILE) or SHARES_SUBDIR in names:
            return store
        if CHECKPOINTS_SUBDIR in names:
            usage_error(
                f"{url} is a run root, not a checkpoint: name one under {url}/{CHECKPOINTS_SUBDIR}/ "
                f"({_latest_hint(store, CHECKPOINTS_SUBDIR)})"
            )
        if store.exists(LATEST_FILE) or url.endswith(f"/{CHECKPOINTS_SUBDIR}"):
            usage_error(
                f"{url} holds the checkpoints, it is not one: name one under it "
                f"({_latest_hint(store, '')})"
            )
    except OSError as exc:
        usage_error(_naming(url, exc))
    usage_error(f"{url} is not a checkpoint: it has no {CHECKPOINT_FILE} and no shares")


def check_store_root(url: str) -> None:
    """Refuse, as a usage error, a run root URL with nothing under it, or that is a checkpoint.

    Raises:
        typer.Exit: With exit code 2, after one line.
    """
    store = _open(url)
    try:
        names = store.subdirectories("")
        if CHECKPOINTS_SUBDIR in names:
            return
        if store.exists(LATEST_FILE) or url.endswith(f"/{CHECKPOINTS_SUBDIR}"):
            usage_error(f"{url} holds the checkpoints: name the run root above it, {_parent(url)}")
        if store.exists(CHECKPOINT_FILE) or SHARES_SUBDIR in names:
            usage_error(f"{url} is one checkpoint: name the run root, {_parent(_parent(url))}")
        if not names:
            usage_error(
                f"{url}: nothing is stored there (name the run root, which holds checkpoints/)"
            )
    except OSError as exc:
        usage_error(_naming(url, exc))
