"""How many files a server process may open, raised to what thousands in flight need (D387).

Every rollout in flight holds a few sockets in each process it passes through: the agent keeps
its caller's connection and its own to the policy and the resources servers, the environment
and the policy server hold theirs. Measured on the drill, the busiest process held 712
descriptors at 300 rollouts at once and 1,999 at 1,000 (``docs/operations.md``). Most Linux
sessions start with a soft limit of 1,024 open files and a hard limit far above it, so a run
of a few hundred rollouts at once failed with ``OSError: [Errno 24] Too many open files``
somewhere in the middle, while the system would have allowed many more.

So a server raises its soft limit towards the hard one as it starts (:func:`raise_open_file_limit`);
every ``midflight`` process does, and the servers and the drill controller it starts inherit the
raised limit. :func:`open_files_needed` sizes the limit a deployment needs.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Final

OPEN_FILES_TARGET: Final = 65_536
"""The soft limit a process asks for when its hard limit allows it: enough for about 25,000
rollouts in flight in one process, and no more, so a hard limit of millions is not copied into
every process (descriptor tables are sized from it)."""
FILES_PER_ROLLOUT: Final = 2.5
"""Descriptors one rollout in flight may hold in the busiest process of a run (2.0 to 2.4
measured; the rest is margin)."""
FILES_AT_REST: Final = 128
"""Descriptors a process holds with nothing in flight: the interpreter, logs, evidence, the
ledger database, listening sockets, pool connections kept alive (measured: 28 to 60)."""


@dataclass(frozen=True)
class OpenFileLimit:
    """A process's limit on open files after :func:`raise_open_file_limit`.

    Attributes:
        soft: What the process may open now (``None``: unlimited).
        hard: The most the soft limit could be raised to (``None``: unlimited).
        raised_from: The soft limit before, when it was raised; ``None`` when left as it was.
    """

    soft: int | None
    hard: int | None
    raised_from: int | None = None


def _finite(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> OpenFileLimit:
    """Raise this process's soft limit on open files to ``target``, or to the hard limit if that
    is lower; never lower it. Children started afterwards inherit the result.

    A system that refuses the change (macOS caps it below an unlimited hard limit) keeps the
    limit it had; the caller learns the limit either way.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = _finite(hard)
    want = target if ceiling is None else min(target, ceiling)
    current = _finite(soft)
    if current is None or current >= want:
        return OpenFileLimit(soft=current, hard=ceiling)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return OpenFileLimit(soft=current, hard=ceiling)
    return OpenFileLimit(soft=want, hard=ceiling, raised_from=current)


def open_files_needed(in_flight: int) -> int:
    """Open files the busiest process of a run with ``in_flight`` rollouts at once may need."""
    return FILES_AT_REST + int(in_flight * FILES_PER_ROLLOUT)
