"""Where ``bench restore`` restores, and how its tables and pictures name it (D447).

Kept apart from :mod:`.process_cluster`, so that drawing a saved JSON (``bench plot``) needs
nothing that starts servers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class RestoreServers(StrEnum):
    """Where ``bench restore`` restores (``--servers``): the bench's own process (the default,
    as every suite), or a process per server."""

    in_process = "in-process"
    processes = "processes"


RESTORED_INTO: Final[dict[str, str]] = {
    RestoreServers.in_process: "one process",
    RestoreServers.processes: "a process per server",
}
"""How a table or a picture names where a restore ran (a payload's ``servers``)."""
