"""The policy server's admission gate: tickets, waiting admission and held responses.

A model call of an episode passes the gate twice. At **admission** a retired attempt is refused;
while a checkpoint is open a new call waits outside (it holds no ticket, so it never blocks a
prepare) until admission reopens or a retire wakes it; otherwise it gets a ticket at once, with no
await between the checks and the ticket. At **egress** (:meth:`ModelGate.deliver`) a finished
call whose response has not started waits while admission is closed: its response is *held* and
goes out at resume. Until then the call counts as undelivered and its ledger row stays out of any
checkpoint.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio

from protocols import (
    AdmissionClosedError,
    EpisodeId,
    GenerationCutPrefixAck,
    GenerationCutRecord,
    attempts_through,
)

from .._runtime.marks import RetireMarks

DEFAULT_ADMISSION_WAIT_SECONDS: Final = 900.0
"""Longest a new call waits for an open checkpoint to resume before ``admission_closed``."""


@dataclass(eq=False)
class ModelTicket:
    """One admitted model call.

    Attributes:
        episode: The attempt the call belongs to; ``None`` for an untagged call (eval, judge,
            probe), which is gated like any other but belongs to no episode.
        model_call_id: The call's id, fixed at admission so an export taken while the call runs
            already knows which ledger row to leave out.
        admitted_at: Wall-clock admission time (recorded in the call's ledger row).
        scope: Cancelled by a retire of the attempt.
        response_started: Whether the response passed egress (the call is delivered).
        held: Whether the response waited at egress for a resume.
        done: Set when the call has left the server.
        backend: The worker the call was sent to (cut rounds group by it).
        request_digest: Conversation digest of the request (matches restored cuts).
        restart_reason: Why the call may never be cut (constrained decoding), if so.
        cut: The worker's ack of this checkpoint's cut round.
        cut_record: The durable cut the checkpoint keeps, for a ``durable_prefix`` ack.
        claimed_cut: The restored cut this call continues.
    """

    episode: EpisodeId | None
    model_call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    admitted_at: float = field(default_factory=time.time)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    response_started: bool = False
    held: bool = False
    waiting_at_egress: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)
    backend: str | None = None
    request_digest: str | None = None
    restart_reason: str | None = None
    cut: GenerationCutPrefixAck | None = None
    cut_record: GenerationCutRecord | None = None
    claimed_cut: GenerationCutRecord | None = None


class ModelGate:
    """Admission and egress for one policy server process.

    Args:
        marks: The retire marks every admission checks.
        notify: Called whenever readiness may have changed.
        admission_wait_seconds: Bound of a waiting admission.
    """

    def __init__(
        self,
        marks: Callable[[], RetireMarks],
        notify: Callable[[], None],
        admission_wait_seconds: float = DEFAULT_ADMISSION_WAIT_SECONDS,
    ) -> None:
        self._marks = marks
        self._notify = notify
        self.admission_wait_seconds = admission_wait_seconds
        self.accepting = True
        self.tickets: dict[str, ModelTicket] = {}
        self._opened = anyio.Event()
        self._wake = anyio.Event()
        self.waiting = 0

    # -- admission ------------------------------------------------------------------------

    async def admit(self, episode: EpisodeId | None) -> ModelTicket:
        """A ticket for a new call of ``episode`` (``None``: untagged), waiting while closed.

        Raises:
            StaleAttemptError: The attempt is retired or fenced (also after waiting).
            AdmissionClosedError: Admission stayed closed for ``admission_wait_seconds``.
        """
        with anyio.move_on_after(self.admission_wait_seconds):
            while True:
                if episode is not None:
                    self._marks().check(episode)
                if self.accepting:
                    ticket = ModelTicket(
                        episode
                    )  # no await since the checks: a close cannot slip in
                    self.tickets[ticket.model_call_id] = ticket
                    self._notify()
                    return ticket
                wake = self._wake
                self.waiting += 1
                self._notify()
                try:
                    await wake.wait()
                finally:
                    self.waiting -= 1
        raise AdmissionClosedError(
            f"a checkpoint stayed open for {self.admission_wait_seconds:g} s; retry after resume"
        )

    def _wake_waiters(self) -> None:
        self._wake.set()
        self._wake = anyio.Event()

    # -- egress ---------------------------------------------------------------------------

    async def deliver(self, ticket: ModelTicket) -> None:
        """Let the response of ``ticket`` start; hold it while admission is closed.

        The hold ends at resume, or when the checkpoint's lease expires (the runtime then
        resumes on its own), or when a retire cancels the ticket's scope.
        """
        while not self.accepting:
            ticket.held = True
            ticket.waiting_at_egress = True
            self._notify()
            await self._opened.wait()
        ticket.waiting_at_egress = False
        ticket.response_started = True  # from here on the call counts as delivered
        self._notify()

    async def wait_open(self) -> None:
        """Return once admission is open (at once when it is)."""
        while not self.accepting:
            await self._opened.wait()

    def release(self, ticket: ModelTicket) -> None:
        """The call has left the server (answered, refused or cancelled)."""
        if self.tickets.pop(ticket.model_call_id, None) is not None:
            ticket.done.set()
            self._notify()

    # -- checkpoint side ------------------------------------------------------------------

    def close(self) -> None:
        """Stop admitting; responses not yet started are held from now on."""
        self.accepting = False
        self._opened = anyio.Event()

    def open(self) -> None:
        """Admit again, wake the waiting calls and deliver the held responses."""
        self.accepting = True
        for ticket in self.tickets.values():  # a cut belongs to the checkpoint that took it
            ticket.cut = None
            ticket.cut_record = None
        self._opened.set()
        self._wake_waiters()

    def undelivered(self) -> set[str]:
        """Ids of admitted calls whose responses have not started."""
        return {t.model_call_id for t in self.tickets.values() if not t.response_started}

    def in_transmission(self) -> list[str]:
        """Calls whose response has started but not yet left the server: their capture keys,
        ``untagged:<model_call_id>`` for an untagged call."""
        return [
            f"untagged:{t.model_call_id}" if t.episode is None else t.episode.capture_key
            for t in self.tickets.values()
            if t.response_started
        ]

    def held_count(self) -> int:
        """Responses waiting at egress now."""
        return sum(t.waiting_at_egress for t in self.tickets.values())

    async def cancel_covered(self, retired: Sequence[EpisodeId]) -> list[ModelTicket]:
        """Wake waiters (they re-check marks), cancel the calls any of ``retired`` covers and
        wait until they left; one pass over the calls for the whole batch (D389).

        Returns:
            The calls cancelled (a retire then stops what they started on their workers).
        """
        self._wake_waiters()
        through = attempts_through(retired)
        # An untagged call belongs to no attempt: a retire never cancels it.
        covered = [
            t
            for t in self.tickets.values()
            if t.episode is not None and t.episode.attempt <= through.get(t.episode.rollout_id, -1)
        ]
        for ticket in covered:
            ticket.scope.cancel()
        for ticket in covered:
            await ticket.done.wait()
        return covered
