"""The participants a coordinator drives, and one call made to all of them at once.

:func:`each` runs a call on every member concurrently and keeps every failure, by server name;
each call is a client span ``gym.checkpoint.call.<operation>`` naming its participant, so a
participant's own span in its own process is a child of it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from opentelemetry.trace import SpanKind

from protocols import DeadlineExceededError, MidflightError, ParticipantKind, WireError, call_span

from ._client import ControlClient
from ._tracing import coordinator_span

T = TypeVar("T")


class CoordinationError(MidflightError):
    """One coordinated operation failed on some participants.

    Attributes:
        operation: The operation (``prepare``, ``commit``, ``restore``, …).
        failures: Server name → what went wrong there.
        causes: Server name → the exception itself (typed ``WireError`` when the server
            answered with an error envelope).
    """

    def __init__(
        self,
        operation: str,
        failures: Mapping[str, str],
        causes: Mapping[str, BaseException] | None = None,
    ) -> None:
        self.operation = operation
        self.failures = dict(failures)
        self.causes = dict(causes or {})
        listed = "; ".join(f"{name}: {message}" for name, message in sorted(self.failures.items()))
        super().__init__(f"{operation} failed: {listed}")

    @property
    def out_of_time(self) -> bool:
        """Whether every participant that failed ran out of time and nothing else.

        Each refused with ``deadline_exceeded`` (retryable with the same id), or its reply did
        not come within the deadline and the client's slack (``TimeoutError``). Sending the same
        operation again with a later deadline is then safe and may succeed: a retried commit
        waits for the write the first one began, and a retire is idempotent (D388, D390, D392).
        """
        causes = self.causes.values()
        return bool(causes) and all(
            isinstance(cause, DeadlineExceededError | TimeoutError) for cause in causes
        )


async def send_while_out_of_time(
    send: Callable[[float], Awaitable[T]],
    deadline: float,
    *,
    seconds: float,
    sends: int,
    on_resend: Callable[[CoordinationError], Awaitable[None]] | None = None,
) -> T:
    """``send(deadline)``, sent again while every participant that refused it ran out of time.

    Each send after the first gets a fresh deadline ``seconds`` away, at most ``sends`` sends in
    all; ``on_resend`` hears of each refusal that is sent again. Only for an operation a repeat
    cannot do twice: a commit (the repeat waits for the write the first began), a retire or a
    resume (idempotent) (D388, D390, D392, D395).

    Raises:
        CoordinationError: Any other refusal, or still out of time after the last send.
    """
    sent = 1
    while True:
        try:
            return await send(deadline)
        except CoordinationError as error:
            if sent >= sends or not error.out_of_time:
                raise
            if on_resend is not None:
                await on_resend(error)
        sent += 1
        deadline = time.time() + seconds


@dataclass(frozen=True)
class Member:
    """One discovered participant.

    Attributes:
        kind: Its participant kind.
        instance: Its server name (a path component of the checkpoint layout).
        url: Its root URL.
        client: Its control client (a reserved connection pool).
    """

    kind: ParticipantKind
    instance: str
    url: str
    client: ControlClient = field(compare=False, repr=False)


def describe(error: BaseException) -> str:
    if isinstance(error, WireError):
        # The wire code first: it is what an operator greps for and what the error table lists.
        return f"{error.code}: {error.detail}"
    return f"{type(error).__name__}: {error}"


async def each(
    operation: str, members: Sequence[Member], call: Callable[[Member], Awaitable[T]]
) -> tuple[dict[str, T], dict[str, BaseException]]:
    """Run ``call`` on every member concurrently; collect replies and failures by server name.

    Each call is a client span ``gym.checkpoint.call.<operation>`` naming its participant.
    """
    replies: dict[str, T] = {}
    failures: dict[str, BaseException] = {}

    async def one(member: Member) -> None:
        try:
            with coordinator_span(
                call_span(operation),
                kind=SpanKind.CLIENT,
                participant_kind=member.kind,
                instance=member.instance,
            ):
                replies[member.instance] = await call(member)
        except Exception as exc:  # any failure is reported per participant, never lost
            failures[member.instance] = exc

    async with anyio.create_task_group() as group:
        for member in members:
            group.start_soon(one, member)
    return replies, failures


def raise_if(operation: str, failures: Mapping[str, BaseException]) -> None:
    if failures:
        raise CoordinationError(
            operation, {name: describe(exc) for name, exc in failures.items()}, failures
        )
