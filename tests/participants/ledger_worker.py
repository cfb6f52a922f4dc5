"""A child process for the ledger's process tests: one durable ledger on a shared directory.

Usage: ``python -m tests.participants.ledger_worker DIR [file|sqlite]`` (``file`` by default),
then commands on stdin, one a line:

- ``run KEY TAG CALLS`` — record CALLS calls (ids ``TAG-<n>``); prints ``done KEY``
- ``manifest KEY`` — prints ``retired`` or ``records <n>``
- ``retire KEY,KEY,... freeze`` — retire; with ``freeze``, stops for good once the fences are
  synced, announcing ``at fences_synced`` (the parent then kills it)
- ``open DIR`` — open (then close) a second ledger of the same layout on DIR; prints
  ``opened`` or ``refused <error>``
- ``quit``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import structlog

from participants import FileCaptureLedger, SqliteCaptureLedger
from protocols import RolloutRetiredError

from .ledger_factory import commit


def main() -> None:
    freeze = {"on": False}

    def on_step(name: str) -> None:
        if freeze["on"] and name == "fences_synced":
            print(f"at {name}", flush=True)
            time.sleep(3600)

    # stdout carries the protocol with the parent; log lines go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    layout = sys.argv[2] if len(sys.argv) > 2 else "file"
    opened = SqliteCaptureLedger if layout == "sqlite" else FileCaptureLedger
    ledger = opened(Path(sys.argv[1]), on_step=on_step)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "run":
            key, tag, calls = words[1], words[2], int(words[3])
            for turn in range(calls):
                work = commit(key, turn, call_id=f"{tag}-{turn}", output=f"{tag} {turn}")
                anyio.run(ledger.record, work)
            print(f"done {key}", flush=True)
        elif words[0] == "manifest":
            try:
                manifest = anyio.run(ledger.manifest, words[1])
                print(f"records {len(manifest.records)}", flush=True)
            except RolloutRetiredError:
                print("retired", flush=True)
        elif words[0] == "open":
            try:
                opened(Path(words[1])).close()
                print("opened", flush=True)
            except Exception as exc:  # the parent names what failed
                print(f"refused {exc!r}", flush=True)
        elif words[0] == "retire":
            freeze["on"] = len(words) > 2 and words[2] == "freeze"
            result = anyio.run(ledger.retire, words[1].split(","))
            print(f"retired {len(result.removed)} {len(result.absent)}", flush=True)
    ledger.close()


if __name__ == "__main__":
    main()
