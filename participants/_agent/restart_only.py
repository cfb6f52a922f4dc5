"""The restart-only agent: sessions of a harness that cannot be continued (control-plane §4.2).

Some harnesses cannot stop at a boundary or describe themselves (an opaque agent process, say).
Such an agent runs the same sessions, but a checkpoint never touches them: they keep running
through it, never block prepare and are reported as **restarts**, so the controller leaves them
out of the commit scope (a commit naming one gets ``409 restart_in_scope``) and, after a crash,
retires the crashed attempt and runs the rollout again from its input. Only new seeds wait while a
checkpoint is open, so the set of restarts stays fixed between prepare and commit. It exports
nothing, and a restore that carries records for it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from protocols import CheckpointError, CheckpointRequest, EpisodeId, PrepareReport

from .._runtime.participant import Record
from .._runtime.report import build_report
from .participant import AgentParticipant


class RestartOnlyAgentParticipant(AgentParticipant):
    """Agent sessions that are restarted after a crash instead of continued.

    Args:
        instance: The server name.
        peers: How to reach the policy model and the resources server.
        hooks: The harness's session hooks; only ``open_agent_session`` and
            ``retire_agent_session`` are ever called (nothing is exported or restored).
    """

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Only new seeds wait; running sessions go on (nothing of them is captured)."""
        self.seeds_accepting = False
        self._opened = type(self._opened)()

    def _in_flight(self) -> list[str]:
        live = [key for key, s in self.sessions.items() if not s.retired]
        return live + list(self._seeds)

    def readiness(self) -> PrepareReport:
        """Always ready; every session and seed in flight is a restart."""
        in_flight = self._in_flight()
        return build_report([], counts={"inflight": len(in_flight)}, restarts=in_flight)

    def ready(self) -> bool:
        """Nothing of a restart-only agent blocks a checkpoint."""
        return True

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """Nothing: a restart-only session cannot be continued."""
        return []

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Accept an empty share only.

        Raises:
            CheckpointError: The share carries records, or the process holds sessions or seeds.
        """
        self._refuse_live_sessions()
        if records:
            raise CheckpointError(
                f"a restart-only agent cannot restore sessions; {len(records)} records offered"
            )

    def status_extra(self) -> dict[str, Any]:
        """Whether seeds are admitted, and that this agent restarts its rollouts."""
        return {"accepting": self.seeds_accepting, "restart_only": True}
