"""The reference servers of one run root as real processes: where ``bench restore --servers
processes`` restores.

The suites park their rollouts on in-process servers, because thousands of rollouts in flight on
real processes need more descriptors and ports than one machine gives (D201). A restore does
not: the coordinator sends one request to each participant, whatever the number of rollouts. So
the restore can be timed where a deployment runs it, each server a process of its own started by
the drill's supervisor (real uvicorn, real sockets on 127.0.0.1), the four participants working
at once on as many cores as the machine has, and the coordinator in the bench's process (D447).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import anyio

from coordinator import Coordinator, discover

from .._launch.supervisor import Supervisor, SupervisorOptions
from .._servers.cluster import PARTICIPANT_ROLES, read_cluster
from .common import TOKEN, Workload

START_TIMEOUT_SECONDS: Final = 60.0
"""Each server's start and health wait: five Python processes importing at once on two cores."""


class ProcessCluster:
    """The five reference servers of ``root``, each a process of its own, and a coordinator.

    Args:
        root: The run root the servers restore from (ledger, staging, checkpoints).
        workload: The worker's token delay comes from it.
    """

    def __init__(self, root: Path, workload: Workload) -> None:
        self.root = root
        self.workload = workload
        self.coordinator: Coordinator | None = None

    @staticmethod
    def transport_of(_url: str) -> None:
        """Every server is reached over the network, on its own URL."""
        return None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ProcessCluster]:
        """Start every server (dependencies first) and discover the participants; on every way
        out, SIGKILL every server the supervisor started."""
        supervisor = Supervisor(
            self.root,
            TOKEN,
            SupervisorOptions(
                role_options={"worker": {"token_delay_ms": self.workload.token_delay_ms}},
                startup_timeout=START_TIMEOUT_SECONDS,
                health_timeout=START_TIMEOUT_SECONDS,
            ),
        )
        # The supervisor waits on processes and sockets: off the event loop. Its start kills
        # what it started when it fails, so only a start that returned needs stopping here.
        await anyio.to_thread.run_sync(supervisor.start_all)
        try:
            cluster = read_cluster(supervisor.cluster_path)
            urls = [server.url for server in cluster.servers if server.role in PARTICIPANT_ROLES]
            async with Coordinator(await discover(urls, token=TOKEN)) as coordinator:
                self.coordinator = coordinator
                yield self
        finally:
            self.coordinator = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(supervisor.kill_all)
