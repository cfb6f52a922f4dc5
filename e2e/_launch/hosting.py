"""A server hosted inside another program's process (a Ray actor's) instead of its own.

A reference server normally owns its process: it prints ``listening on <url>`` on stdout for its
supervisor, takes SIGTERM as its stop, and starts its shard processes with its own command line.
A host that runs the server in a thread of its own process says so once, with
:func:`host_in_this_process`: the URL goes to the host's callback, the shards get the ``serve``
command line the host gave, and the server runs until the host's process dies (D336).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosting:
    """How a server runs when something other than its own process started it (a Ray actor).

    Attributes:
        argv: The ``serve`` command line (without ``python -m e2e``): what a shard process runs.
        announce: Called with the URL once the server listens, instead of printing the
            ``listening on`` line.
    """

    argv: Sequence[str]
    announce: Callable[[str], None]


_hosting: Hosting | None = None


def host_in_this_process(hosting: Hosting) -> None:
    """Serve under ``hosting`` from now on (one server per process: a host's own process)."""
    global _hosting
    _hosting = hosting


def serve_argv() -> list[str]:
    """The ``serve`` command line of this process (what its shard processes run)."""
    return list(_hosting.argv) if _hosting is not None else sys.argv[1:]


def on_main_thread() -> bool:
    """Whether this server runs on the main thread (its own process), so it owns the signals."""
    return threading.current_thread() is threading.main_thread()


def announce_listening(url: str) -> None:
    """Say the server listens: the ``listening on`` line on stdout, or the host's callback.

    Nobody reads stdout after that line, so anything printed later goes to stderr: it must not
    fill the pipe.
    """
    if _hosting is not None:
        _hosting.announce(url)
        return
    sys.stdout.write(f"listening on {url}\n")
    sys.stdout.flush()
    sys.stdout = sys.stderr


__all__ = ["Hosting", "announce_listening", "host_in_this_process", "on_main_thread", "serve_argv"]
