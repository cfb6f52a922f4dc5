"""The fixed-order operations: one checkpoint operation across every participant.

The coordinator holds no state of its own between calls; every call may be repeated with the same
checkpoint id. The orders come from ``protocols``: prepare walks ``PREPARE_ORDER`` stage by stage
(callers park before the callees they wait on), resume walks it backwards (no server reopens
before the servers it calls), retire and forget walk ``RETIRE_ORDER`` (callers stop before
callees), and commit, restore and renew go to everyone at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import anyio
from pydantic import ValidationError

from protocols import (
    COLLECTION_RESTORE_SPAN,
    PREPARE_ORDER,
    RESTORE_CLEANUP_MIN_SECONDS,
    RESUME_ORDER,
    RETIRE_ORDER,
    CommitReply,
    EpisodeId,
    ForgetReply,
    InvalidRequestError,
    InvalidRolloutIdError,
    ParticipantKind,
    Phase,
    PrepareReply,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    coordinate_span,
    encode_wire,
    refuse_unrestorable,
    stage_span,
    validate_rollout_ids,
)

from ._members import CoordinationError, Member, each, raise_if
from ._tracing import coordinator_span, link_to_checkpoint, stored_traceparent

T = TypeVar("T")
P = ParamSpec("P")
NO_MODEL: Final = "no policy model takes part in checkpoints"
BoundaryHook = Callable[[str], Awaitable[None]]
"""Called with a boundary name as the coordinator passes it (a test harness's kill point)."""


async def _no_boundary_hook(_boundary: str) -> None:
    return None


@dataclass(frozen=True)
class PrepareResult:
    """What a coordinated prepare found.

    Attributes:
        prepared: Whether every participant replied ``prepared``.
        replies: Server name → its prepare reply, for the stages that were asked.
    """

    prepared: bool
    replies: Mapping[str, PrepareReply]

    def blockers(self) -> dict[str, list[str]]:
        """Server name → its blocking capture keys, for each reply that is not prepared."""
        return {
            name: list(reply.report.blockers)
            for name, reply in self.replies.items()
            if reply.phase != Phase.PREPARED
        }

    def blocking_episodes(self) -> list[EpisodeId]:
        """The episodes that kept prepare from completing (to retire and re-dispatch)."""
        keys = {key for blockers in self.blockers().values() for key in blockers}
        episodes = []
        for key in sorted(keys):
            try:
                episodes.append(EpisodeId.from_capture_key(key))
            except (InvalidRolloutIdError, ValueError):
                continue  # a synthetic blocker (say, a lost worker) names no episode
        return episodes

    def restarts(self) -> set[EpisodeId]:
        """Every episode some participant cannot capture: a rollout restarts if any part does."""
        return {
            EpisodeId.from_capture_key(key)
            for reply in self.replies.values()
            for key in reply.report.restarts
        }

    def continued(self, episodes: Iterable[EpisodeId]) -> list[EpisodeId]:
        """The commit scope: ``episodes`` minus the restarts, in the given order."""
        restarts = self.restarts()
        return [episode for episode in episodes if episode not in restarts]


def _coordinated(
    operation: str,
) -> Callable[
    [Callable[Concatenate[Coordinator, str, P], Coroutine[Any, Any, T]]],
    Callable[Concatenate[Coordinator, str, P], Coroutine[Any, Any, T]],
]:
    """Run a coordinator operation in its span ``gym.checkpoint.coordinate.<operation>``."""

    def wrap(
        method: Callable[Concatenate[Coordinator, str, P], Coroutine[Any, Any, T]],
    ) -> Callable[Concatenate[Coordinator, str, P], Coroutine[Any, Any, T]]:
        async def traced(
            self: Coordinator, checkpoint_id: str, /, *args: P.args, **kwargs: P.kwargs
        ) -> T:
            with coordinator_span(coordinate_span(operation), id=checkpoint_id):
                return await method(self, checkpoint_id, *args, **kwargs)

        functools.update_wrapper(traced, method)  # the method's name and docstring
        return traced

    return wrap


class Coordinator:
    """Drives checkpoint operations across a fixed set of participants.

    Members are sorted by (``PREPARE_ORDER`` index, server name). Use it as an async context
    manager, or call :meth:`aclose`, to close the members' control clients.

    Args:
        members: The participants (usually from :func:`discover`).
        on_boundary: Awaited with the name of each boundary between stages as it is passed —
            ``some-prepared`` (the first stage prepared, the next not asked), ``prepare-sent``
            (every stage prepared, nothing committed), ``resume-partly-sent`` and
            ``retire-partly-applied`` (the first group done, the others not asked). For test
            harnesses that kill the controller there; nothing by default.

    Raises:
        ValueError: Two members share a server name.
    """

    def __init__(
        self, members: Iterable[Member], *, on_boundary: BoundaryHook | None = None
    ) -> None:
        self._on_boundary = on_boundary or _no_boundary_hook
        ordered = sorted(members, key=lambda m: (PREPARE_ORDER.index(m.kind), m.instance))
        names = [member.instance for member in ordered]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique, got {names}")
        self.members: tuple[Member, ...] = tuple(ordered)

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every member's control client."""
        for member in self.members:
            await member.client.aclose()

    def of_kinds(self, kinds: Iterable[ParticipantKind]) -> list[Member]:
        """The members whose kind is in ``kinds``, in member order."""
        wanted = set(kinds)
        return [member for member in self.members if member.kind in wanted]

    @_coordinated("prepare")
    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareResult:
        """Prepare stage by stage in ``PREPARE_ORDER``; stop after the first unprepared stage.

        Raises:
            CoordinationError: A participant failed or refused (the caller resumes to abort).
        """
        replies: dict[str, PrepareReply] = {}
        for kind in PREPARE_ORDER:
            stage = self.of_kinds((kind,))
            if not stage:
                continue
            with coordinator_span(stage_span(kind), id=checkpoint_id, participants=len(stage)):
                got, failures = await each(
                    "prepare", stage, lambda m: m.client.prepare(checkpoint_id, deadline_ts)
                )
            raise_if("prepare", failures)
            replies.update(got)
            if any(reply.phase != Phase.PREPARED for reply in got.values()):
                return PrepareResult(prepared=False, replies=replies)
            if len(replies) == len(got):
                await self._on_boundary("some-prepared")
        await self._on_boundary("prepare-sent")
        return PrepareResult(prepared=True, replies=replies)

    @_coordinated("commit")
    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: Sequence[EpisodeId] | None,
        *,
        stop: bool = False,
        kinds: Iterable[ParticipantKind] | None = None,
    ) -> dict[str, CommitReply]:
        """Commit on every participant at once (only those of ``kinds`` when given).

        Raises:
            CoordinationError: Any participant failed; nothing may be published.
        """
        replies, failures = await each(
            "commit",
            self.members if kinds is None else self.of_kinds(kinds),
            lambda m: m.client.commit(
                checkpoint_id, deadline_ts, checkpoint_dir, episode_ids, stop=stop
            ),
        )
        raise_if("commit", failures)
        return replies

    @_coordinated("resume")
    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, ResumeReply]:
        """Resume in reverse prepare order, going on past failures.

        Raises:
            CoordinationError: At the end, naming every participant that failed.
        """
        replies: dict[str, ResumeReply] = {}
        failures: dict[str, BaseException] = {}
        for kind in RESUME_ORDER:
            stage = self.of_kinds((kind,))
            got, failed = await each(
                "resume", stage, lambda m: m.client.resume(checkpoint_id, deadline_ts)
            )
            replies.update(got)
            failures.update(failed)
            if stage and len(replies) + len(failures) == len(stage):
                await self._on_boundary("resume-partly-sent")
        raise_if("resume", failures)
        return replies

    @_coordinated("renew")
    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, RenewReply]:
        """Extend every lease at once (publication is taking long).

        Raises:
            CoordinationError: Any participant failed.
        """
        replies, failures = await each(
            "renew", self.members, lambda m: m.client.renew(checkpoint_id, deadline_ts)
        )
        raise_if("renew", failures)
        return replies

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: Sequence[EpisodeId],
    ) -> dict[str, RestoreReply]:
        """Restore on every participant at once, all or nothing.

        If any participant fails, the next attempts of the scope are retired everywhere (so
        whatever did install is freed and refused), everyone is resumed, and the error is raised;
        the controller then reruns those rollouts from input as later attempts.

        Raises:
            InvalidRequestError: The scope names an attempt with no next attempt (D361), or
                two attempts of one rollout (D365), or the request is one no participant would
                take (a malformed checkpoint id, an empty directory); nothing was sent.
            CoordinationError: The restore failed somewhere; its ``failures`` also name any
                participant whose cleanup failed (``<name> (cleanup retire|resume)``).
        """
        try:
            # One request for every participant, checked and encoded once (D438). Its
            # validation checks the scope (D361, D365); only a refused request checks it again,
            # for the scope's own message.
            request = RestoreRequest(
                checkpoint_id=checkpoint_id,
                deadline_ts=deadline_ts,
                checkpoint_dir=checkpoint_dir,
                episode_ids=list(episode_ids),
            )
        except ValidationError as exc:
            try:
                refuse_unrestorable(episode_ids)
            except ValueError as refusal:
                raise InvalidRequestError(str(refusal)) from None
            raise InvalidRequestError(f"the restore request is malformed: {exc}") from None
        with coordinator_span(
            COLLECTION_RESTORE_SPAN,
            new_trace=True,
            id=checkpoint_id,
            source=checkpoint_dir.rstrip("/").rsplit("/", 1)[-1],  # the checkpoint it restores
            episodes=len(episode_ids),
        ) as span:
            if span.is_recording():
                stored = await anyio.to_thread.run_sync(stored_traceparent, checkpoint_dir)
                link_to_checkpoint(span, stored)
            return await self._restore(request)

    async def _restore(self, request: RestoreRequest) -> dict[str, RestoreReply]:
        # Built once per participant, the request cost about 7 ms of the coordinator's event
        # loop each at 16,000 episodes; the bytes are the same for everyone (D438).
        wire = encode_wire(request)
        checkpoint_id, deadline_ts = request.checkpoint_id, request.deadline_ts
        episode_ids = request.episode_ids
        replies, failures = await each(
            "restore", self.members, lambda m: m.client.send_restore(request, wire)
        )
        if not failures:
            return replies
        cleanup_deadline = max(deadline_ts, time.time() + RESTORE_CLEANUP_MIN_SECONDS)
        problems: dict[str, BaseException] = dict(failures)
        try:
            await self.retire(
                checkpoint_id, cleanup_deadline, [e.next_attempt() for e in episode_ids]
            )
        except CoordinationError as exc:
            problems.update({f"{name} (cleanup retire)": c for name, c in exc.causes.items()})
        finally:
            try:
                await self.resume(checkpoint_id, cleanup_deadline)
            except CoordinationError as exc:
                problems.update({f"{name} (cleanup resume)": c for name, c in exc.causes.items()})
            raise_if("restore", problems)
        raise AssertionError("unreachable")  # pragma: no cover - _raise_if raised above

    @_coordinated("retire")
    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episode_ids: Sequence[EpisodeId]
    ) -> dict[str, RetireReply]:
        """Retire group by group in ``RETIRE_ORDER``, going on past failures; no-op when empty.

        Raising a mark is always safe, so a failed group does not stop the later ones: every
        participant that can refuse the attempts does.

        Raises:
            CoordinationError: At the end, naming every participant that failed (retire is safe
                to repeat).
        """
        episodes = list(dict.fromkeys(episode_ids))
        if not episodes:
            return {}
        replies: dict[str, RetireReply] = {}
        failures: dict[str, BaseException] = {}
        for group in RETIRE_ORDER:
            stage = self.of_kinds(group)
            got, failed = await each(
                "retire", stage, lambda m: m.client.retire(checkpoint_id, deadline_ts, episodes)
            )
            replies.update(got)
            failures.update(failed)
            if stage and len(replies) + len(failures) == len(stage):
                await self._on_boundary("retire-partly-applied")
        raise_if("retire", failures)
        return replies

    @_coordinated("forget")
    async def forget(
        self, checkpoint_id: str, deadline_ts: float, rollout_ids: Iterable[str]
    ) -> dict[str, ForgetReply]:
        """Forget group by group in ``RETIRE_ORDER``; stop after the first group that fails.

        Forgetting lowers a fence, so it fails closed: a callee keeps its marks while a caller
        still refuses to forget (its retired state is not freed yet).

        Raises:
            InvalidRolloutIdError: A rollout id is malformed (nothing was sent).
            CoordinationError: A group failed; later groups were not asked.
        """
        rollouts = sorted(validate_rollout_ids(rollout_ids))
        if not rollouts:
            return {}
        replies: dict[str, ForgetReply] = {}
        for group in RETIRE_ORDER:
            got, failed = await each(
                "forget",
                self.of_kinds(group),
                lambda m: m.client.forget(checkpoint_id, deadline_ts, rollouts),
            )
            raise_if("forget", failed)
            replies.update(got)
        return replies
