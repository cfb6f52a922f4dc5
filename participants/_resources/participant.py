"""The resources participant (kind ``resources``): sessions that tools act on, learned from requests.

A resources server keeps per-session state (a counter, a sandbox, …) that tool calls mutate. This
participant tracks which session belongs to which attempt, counts requests in flight, makes
requests wait out an open checkpoint inside the server (control-plane §4.3, errata §10.15 to §10.17),
and moves session state in and out of checkpoints through :class:`ResourcesSessionHooks`.

The server wraps each data request in :meth:`ResourcesParticipant.admit` and reports the session
lifecycle with :meth:`~ResourcesParticipant.bind_session` (a seed) and
:meth:`~ResourcesParticipant.end_session` (verify or close). A server whose sessions start or
end where no request shows it calls :meth:`~ResourcesParticipant.session_started` and
:meth:`~ResourcesParticipant.session_ended` instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog

from protocols import (
    AdmissionClosedError,
    CheckpointError,
    CheckpointRequest,
    EpisodeId,
    ParticipantKind,
    PrepareReport,
    StaleAttemptError,
    validate_safe_name,
)

from .._runtime.participant import BaseParticipant, Record
from .._runtime.report import build_report
from .models import (
    DEFAULT_ADMISSION_WAIT_SECONDS,
    RESOURCES_MODES,
    VERIFY_MODES,
    ResourcesAdmission,
    ResourcesMode,
    ResourcesRoute,
    ResourcesSession,
    ResourcesSessionHooks,
    VerifyMode,
    parse_session_records,
    session_records,
)
from .retire import SessionRetire

_log = structlog.get_logger("midflight.resources")


class ResourcesParticipant(SessionRetire, BaseParticipant):
    """Session bookkeeping and checkpoint hooks of one resources server.

    Args:
        instance: The server's name.
        hooks: Where session state lives.
        mode: ``exported`` (state in the checkpoint), ``stateless`` or ``restart_only``.
        verify: ``wait`` (a checkpoint waits for verify) or ``replay`` (verify is re-run).
        admission_wait_seconds: Bound on a request's wait for resume.
    """

    kind: ParticipantKind = "resources"

    def __init__(
        self,
        instance: str,
        hooks: ResourcesSessionHooks,
        *,
        mode: ResourcesMode = "exported",
        verify: VerifyMode = "wait",
        admission_wait_seconds: float = DEFAULT_ADMISSION_WAIT_SECONDS,
    ) -> None:
        super().__init__()
        if mode not in RESOURCES_MODES or verify not in VERIFY_MODES:
            raise ValueError(f"unknown mode {mode!r} or verify mode {verify!r}")
        self.instance = validate_safe_name(instance, what="instance")
        self.hooks = hooks
        self.mode: ResourcesMode = mode
        self.verify: VerifyMode = verify
        self.admission_wait_seconds = admission_wait_seconds
        self.sessions: dict[str, ResourcesSession] = {}
        self.seeds: Counter[EpisodeId] = Counter()
        self.inflight = 0
        self.waiting = 0
        self.accepting = True
        self._opened = anyio.Event()
        self._opened.set()
        self._served = False

    # ----------------------------------------------------------------- data plane

    def _replayable(self, route: ResourcesRoute) -> bool:
        return route == "verify" and self.verify == "replay"

    def _waits_while_closed(self, route: ResourcesRoute) -> bool:
        if self._replayable(route):
            return False
        # A restart-only server holds nothing in a checkpoint, so only new sessions wait.
        return self.mode != "restart_only" or route == "seed"

    async def _wait_for_open(self, route: ResourcesRoute) -> None:
        while not self.accepting and self._waits_while_closed(route):
            self.waiting += 1
            self.changes.notify()
            try:
                with anyio.fail_after(self.admission_wait_seconds):
                    await self._opened.wait()
            except TimeoutError:
                raise AdmissionClosedError(
                    f"a checkpoint stayed open for {self.admission_wait_seconds:g} s; retry"
                ) from None
            finally:
                self.waiting -= 1
                self.changes.notify()

    def _check(
        self, route: ResourcesRoute, episode_id: EpisodeId | None, session_id: str | None
    ) -> ResourcesSession | None:
        """The admission rules after any wait; no await may come between this and counting."""
        if route == "close":  # never refused: its caller closes only once (errata §10.15)
            return self.sessions.get(session_id) if session_id is not None else None
        if episode_id is not None:
            self.marks.check(episode_id)
        if route == "seed":
            return None
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is None:
            raise CheckpointError(f"unknown session {str(session_id)[:80]!r}")
        if session.retired or self.marks.is_retired(session.episode_id):
            raise StaleAttemptError(f"session of {session.episode_id.capture_key} was retired")
        if episode_id is not None and session.episode_id != episode_id:
            if session.episode_id.rollout_id == episode_id.rollout_id:
                raise StaleAttemptError(
                    f"the session belongs to {session.episode_id.capture_key}, "
                    f"not {episode_id.capture_key}"
                )
            raise CheckpointError(
                f"the session belongs to another rollout, not {episode_id.capture_key}"
            )
        return session

    @asynccontextmanager
    async def admit(
        self,
        route: ResourcesRoute,
        *,
        episode_id: EpisodeId | None,
        session_id: str | None,
    ) -> AsyncIterator[ResourcesAdmission]:
        """Admit one data request for as long as the block runs.

        While a checkpoint is open a non-replayable request waits here for resume, then the
        admission rules apply: a retired or fenced attempt is ``stale_attempt``, an unknown or
        foreign session ``checkpoint_error`` (``/close_session`` is never refused).

        Raises:
            StaleAttemptError: The attempt or its session was retired or fenced.
            CheckpointError: The session is unknown or belongs to another rollout.
            AdmissionClosedError: The checkpoint stayed open past ``admission_wait_seconds``.
        """
        await self._wait_for_open(route)
        session = self._check(route, episode_id, session_id)
        if route == "close" and session is None:
            yield ResourcesAdmission(route, episode_id, None, counted=False)
            return
        counted = not self._replayable(route)
        if session is not None:
            session.restored_pending = False  # admitting claims a restored session
        if counted:
            self.inflight += 1
            if route == "seed":
                assert episode_id is not None, "a seed names its episode"
                self.seeds[episode_id] += 1
            elif session is not None:
                session.inflight += 1
        self._served = True
        self.changes.notify()
        try:
            yield ResourcesAdmission(route, episode_id, session, counted)
        finally:
            if counted:
                self.inflight -= 1
                if route == "seed" and episode_id is not None:
                    self.seeds[episode_id] -= 1
                    if self.seeds[episode_id] <= 0:
                        del self.seeds[episode_id]
                elif session is not None:
                    session.inflight -= 1
            self.changes.notify()

    async def bind_session(self, session_id: str, episode_id: EpisodeId) -> None:
        """A seed created ``session_id`` for ``episode_id`` (call while the seed is admitted).

        Raises:
            StaleAttemptError: The attempt was retired meanwhile; the new state is freed.
            CheckpointError: The id is already bound.
        """
        if session_id in self.sessions:
            raise CheckpointError(f"session {session_id!r} already exists")
        if self.marks.is_retired(episode_id):
            await self.hooks.retire_session_state(session_id)
            raise StaleAttemptError(f"{episode_id.capture_key} was retired while seeding")
        self.sessions[session_id] = ResourcesSession(session_id, episode_id)
        self.changes.notify()

    async def end_session(self, admission: ResourcesAdmission) -> None:
        """Verify or close ended the admitted session: free it (or defer that, see below).

        A replayable verify is not counted, so it may end a session while a checkpoint is open;
        the session then stays exported (a restore re-runs the verify from the boundary before
        it) and is freed at resume.
        """
        session = admission.session
        if session is None or session.retired:
            return  # nothing bound, or retired: its retire frees it
        if not admission.counted and not self.accepting:
            session.end_deferred = True
            return
        await self._free(session)

    async def session_started(self, session_id: str, episode_id: EpisodeId) -> None:
        """A session began where no seed request shows it (a hidden lifecycle): track it.

        An open checkpoint does not delay it; from the next prepare on it is like any other.

        Raises:
            StaleAttemptError: The attempt is retired or fenced; the new state is freed.
            CheckpointError: The id is already tracked.
        """
        self._served = True  # a process that tracked a session may no longer restore
        await self.bind_session(session_id, episode_id)

    async def session_ended(self, session_id: str) -> None:
        """A session ended outside any verify or close request (a hidden lifecycle): free it.

        While a checkpoint is open the free waits for resume, so the state the prepare saw is the
        state the commit exports. An unknown or retired session is a no-op (retire frees those).
        """
        session = self.sessions.get(session_id)
        if session is None or session.retired:
            return
        if not self.accepting:
            session.end_deferred = True
            return
        await self._free(session)

    async def _free(self, session: ResourcesSession) -> None:
        await self.hooks.retire_session_state(session.session_id)
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        self.changes.notify()

    # ----------------------------------------------------------------- admission

    async def close_admission(self, request: CheckpointRequest) -> None:
        """Requests arriving from now on wait for resume (except a replayable verify)."""
        if self.accepting:
            self.accepting = False
            self._opened = anyio.Event()

    async def open_admission(self) -> None:
        """Release the waiting requests, then free sessions whose end was deferred."""
        self.accepting = True
        self._opened.set()
        for session in [s for s in self.sessions.values() if s.end_deferred]:
            if not session.retired:
                await self._free(session)
        self.changes.notify()

    # ----------------------------------------------------------------- readiness

    def _retired_keys(self) -> list[str]:
        return [s.episode_id.capture_key for s in self.sessions.values() if s.retired]

    def _inflight_keys(self) -> list[str]:
        keys = [s.episode_id.capture_key for s in self.sessions.values() if s.inflight > 0]
        return keys + [episode.capture_key for episode in self.seeds]

    def readiness(self) -> PrepareReport:
        """Ready iff nothing counted is in flight (restart-only: ignored) and no retired session
        is still tracked; blockers name both."""
        blockers = self._retired_keys()
        if self.mode != "restart_only":
            blockers += self._inflight_keys()
        restarts: list[str] = []
        if self.mode == "restart_only":
            restarts = [s.episode_id.capture_key for s in self.sessions.values() if not s.retired]
        return build_report(
            blockers,
            counts={
                "inflight": self.inflight,
                "sessions": len(self.sessions),
                "waiting": self.waiting,
            },
            restarts=restarts,
        )

    def ready(self) -> bool:
        """Cheap: no retired session tracked and (restart-only or) nothing in flight."""
        if any(s.retired for s in self.sessions.values()):
            return False
        return self.mode == "restart_only" or self.inflight == 0

    def status_extra(self) -> dict[str, Any]:
        """Mode, verify mode and the count of retired sessions not yet freed."""
        return {
            "mode": self.mode,
            "verify": self.verify,
            "retired_sessions": len(self._retired_keys()),
        }

    def served_live_work(self) -> bool:
        """Whether any request was admitted, or a session or request exists."""
        return self._served or bool(self.sessions) or self.inflight > 0 or bool(self.seeds)

    def restored_pending(self) -> list[EpisodeId]:
        """Attempts with a restored session no request has claimed yet."""
        found = {s.episode_id for s in self.sessions.values() if s.restored_pending}
        return sorted(found, key=lambda e: e.capture_key)

    # ----------------------------------------------------------------- export / install

    async def export(self, episode_ids: Sequence[EpisodeId] | None) -> list[Record]:
        """``{"episode_id", "session_id", "state"}`` per live session in scope (exported mode)."""
        if self.mode != "exported":
            return []
        wanted = None if episode_ids is None else {e.capture_key for e in episode_ids}
        chosen = [
            s
            for s in sorted(self.sessions.values(), key=lambda s: s.session_id)
            if not s.retired and (wanted is None or s.episode_id.capture_key in wanted)
        ]
        states = await self.hooks.export_session_states([s.session_id for s in chosen])
        records, vanished = session_records(chosen, states)
        for session_id in vanished:
            _log.warning("resources.session_vanished", session_id=session_id)
            self.sessions.pop(session_id, None)
        return records

    async def install(self, records: Sequence[Record], scope: Sequence[EpisodeId]) -> None:
        """Validate every record, restore every state, then bind each session to its next attempt.

        Raises:
            CheckpointError: The process has sessions or requests, or the mode exports nothing.
            InvalidCheckpointStateError: A record is malformed or two name the same session.
        """
        if self.sessions or self.inflight or self.seeds:
            raise CheckpointError("restore needs a resources server that has not served sessions")
        if records and self.mode != "exported":
            raise CheckpointError(f"a {self.mode} resources server cannot restore session state")
        bound, states = parse_session_records(records, scope)
        if states:
            await self.hooks.restore_session_states(states)
        for session_id, episode in bound.items():
            self.sessions[session_id] = ResourcesSession(session_id, episode, restored_pending=True)
        self.changes.notify()

    async def delete_restored(self, episode_id: EpisodeId) -> None:
        """Free the unclaimed restored sessions of ``episode_id``; the attempt is not refused."""
        for session in list(self.sessions.values()):
            if session.restored_pending and session.episode_id == episode_id:
                await self._free(session)
