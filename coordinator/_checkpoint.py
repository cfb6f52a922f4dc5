"""The high-level checkpoint: prepare, commit, publish, resume, in one call.

When a participant stays blocked, nothing is committed: everyone is resumed and the blockers come
back for the caller to retire and re-dispatch. When anything fails on the way, everyone is resumed
(which aborts the unpublished checkpoint) and the error is raised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
from pydantic import JsonValue

from protocols import (
    PREPARE_ORDER,
    RESTORE_CLEANUP_MIN_SECONDS,
    CommitReply,
    EpisodeId,
    ParticipantKind,
    open_store,
)

from ._fixed_order import Coordinator, PrepareResult
from ._layout import CHECKPOINT_FILE, checkpoint_key, checkpoint_location, latest_id
from ._members import CoordinationError, send_while_out_of_time
from ._publish import CheckpointManifest, publish_checkpoint
from ._tracing import checkpoint_trace

_SCOPE_KINDS: Final[tuple[ParticipantKind, ...]] = ("environment",)
"""The participants whose export is the default scope of a checkpoint."""


@dataclass(frozen=True)
class CheckpointOutcome:
    """What :func:`checkpoint` did.

    Attributes:
        checkpoint_id: The id used on every call (also on every retry).
        prepare: The prepare result (its blockers, restarts and continued scope).
        manifest: The published ``checkpoint.json``, or ``None`` when blockers remained.
        commits_resent: How many commits were sent again because every participant that
            refused them ran out of time (``commit_sends``; D392).
    """

    checkpoint_id: str
    prepare: PrepareResult
    manifest: CheckpointManifest | None
    commits_resent: int = 0

    @property
    def published(self) -> bool:
        """Whether the checkpoint was published."""
        return self.manifest is not None

    def blocking_episodes(self) -> list[EpisodeId]:
        """The episodes that kept prepare from completing (to retire and re-dispatch)."""
        return self.prepare.blocking_episodes()


async def _resume_quietly(coordinator: Coordinator, checkpoint_id: str) -> None:
    # A cleanup resume gets a fresh window: the checkpoint's own deadline may be spent already.
    await coordinator.resume(checkpoint_id, time.time() + RESTORE_CLEANUP_MIN_SECONDS)


@dataclass
class _Commits:
    """``Coordinator.commit`` of one checkpoint, sent again while it runs out of time.

    A prepare that waited for thousands of episodes to park can leave the commit too little of
    the deadline. Each participant that refused with ``deadline_exceeded`` goes on writing what
    it exported, so the same commit, sent again with a fresh deadline of ``deadline_seconds``,
    waits for that write instead of exporting again (D388, D392). ``sends`` bounds the sends of
    one commit; any other refusal is raised at once.
    """

    coordinator: Coordinator
    checkpoint_id: str
    directory: str
    deadline: float
    deadline_seconds: float
    sends: int
    resent: int = 0

    async def __call__(
        self, scope: Sequence[EpisodeId] | None, kinds: Sequence[ParticipantKind] | None = None
    ) -> dict[str, CommitReply]:
        async def send(deadline: float) -> dict[str, CommitReply]:
            self.deadline = deadline  # a later commit of the checkpoint starts from it
            return await self.coordinator.commit(
                self.checkpoint_id, deadline, self.directory, scope, kinds=kinds
            )

        async def count(error: CoordinationError) -> None:
            self.resent += 1

        return await send_while_out_of_time(
            send, self.deadline, seconds=self.deadline_seconds, sends=self.sends, on_resend=count
        )


async def _commit_what_the_environment_exports(
    commit: _Commits, prepared: PrepareResult
) -> tuple[dict[str, CommitReply], list[EpisodeId]]:
    """Commit with no scope given: the environments first, then everyone else with their export.

    A model participant needs the episodes the controller continues (it must not export the
    rows of an attempt nobody will run again), so the default scope — what the environments
    export, minus the restarts — is known only once they have committed.
    """
    first = await commit(None, kinds=_SCOPE_KINDS)
    exported = sorted({key for reply in first.values() for key in reply.episode_ids})
    scope = prepared.continued(EpisodeId.from_capture_key(key) for key in exported)
    others = [kind for kind in PREPARE_ORDER if kind not in _SCOPE_KINDS]
    rest = await commit(scope, kinds=others)
    return {**first, **rest}, scope


def _remove_unpublished(root: str | Path, checkpoint_id: str) -> None:
    """Remove what a failed commit of ``checkpoint_id`` wrote, unless it was published.

    A checkpoint without ``checkpoint.json`` is ignored by every reader of checkpoints, but it
    still looks like one to a person or a tool listing ``checkpoints/``; the coordinator that
    saw the commit fail knows it will never be published, so it removes it (a participant still
    writing after its reply was lost may leave a share behind; gc removes it later). Never
    touches a checkpoint with ``checkpoint.json`` or the one ``LATEST`` names.
    """
    store = open_store(root)
    if store.exists(checkpoint_key(checkpoint_id, CHECKPOINT_FILE)):
        return
    if latest_id(store) == checkpoint_id:
        return
    store.delete_tree(checkpoint_key(checkpoint_id))


async def checkpoint(
    coordinator: Coordinator,
    root: str | Path,
    checkpoint_id: str,
    *,
    deadline_seconds: float,
    episodes: Sequence[EpisodeId] | None = None,
    controller_state: JsonValue = None,
    commit_sends: int = 1,
    fault: str | None = None,
) -> CheckpointOutcome:
    """Take one checkpoint across every participant and publish it under ``root``.

    Args:
        coordinator: The participants.
        root: The run root, a directory or ``s3://bucket/prefix`` (the checkpoint goes to
            ``<root>/checkpoints/<id>``, :func:`checkpoint_location`).
        checkpoint_id: The checkpoint's id; retries reuse it.
        deadline_seconds: How long prepare, commit and publication may take in all.
        episodes: The episodes to continue, or ``None`` for everything the environments export
            (minus restarts): they commit first, the others then with that scope.
        controller_state: The controller's own state, published in ``checkpoint.json``.
        commit_sends: How many times to send a commit that every participant refusing it
            refused for time alone (``deadline_exceeded``, or no reply in time), each send
            after the first with a fresh ``deadline_seconds``. The default, 1, keeps the pause
            within ``deadline_seconds``; more trades a longer pause for the checkpoint at
            thousands in flight (D392). ``outcome.commits_resent`` counts the extra sends.
        fault: A test-only publication fault (see ``PUBLISH_FAULTS``).

    Returns:
        The outcome; ``manifest`` is ``None`` when some participant stayed blocked (everyone has
        been resumed; retire ``blocking_episodes()`` and dispatch them again).

    Raises:
        ValueError: ``commit_sends`` is below 1 (nothing was sent).
        CoordinationError: A participant failed (everyone was resumed before raising).
        InvalidCheckpointStateError: Publication found a missing or changed manifest.
        PublicationConflictError: Another publication got to the store first
            (:class:`LatestMovedError`: this checkpoint stays published, ``LATEST`` is the
            other's; :class:`CheckpointTakenError`: the id holds another publication).
    """
    if commit_sends < 1:
        raise ValueError(f"commit_sends must be at least 1, not {commit_sends}")
    with checkpoint_trace(checkpoint_id, participants=len(coordinator.members)) as traced:
        outcome = await _checkpoint(
            coordinator,
            root,
            checkpoint_id,
            deadline_seconds=deadline_seconds,
            episodes=episodes,
            controller_state=controller_state,
            commit_sends=commit_sends,
            fault=fault,
            traceparent=traced.traceparent,
        )
        traced.record(
            published=outcome.published,
            rollouts=None if outcome.manifest is None else len(outcome.manifest.continued),
            blockers=sum(len(keys) for keys in outcome.prepare.blockers().values()),
        )
        return outcome


async def _checkpoint(
    coordinator: Coordinator,
    root: str | Path,
    checkpoint_id: str,
    *,
    deadline_seconds: float,
    episodes: Sequence[EpisodeId] | None,
    controller_state: JsonValue,
    commit_sends: int,
    fault: str | None,
    traceparent: str | None,
) -> CheckpointOutcome:
    deadline = time.time() + deadline_seconds
    directory = checkpoint_location(root, checkpoint_id)
    commit = _Commits(
        coordinator, checkpoint_id, directory, deadline, deadline_seconds, commit_sends
    )
    try:
        result = await coordinator.prepare(checkpoint_id, deadline)
        if not result.prepared:
            await _resume_quietly(coordinator, checkpoint_id)
            return CheckpointOutcome(checkpoint_id, result, None)
        if episodes is None:
            commits, scope = await _commit_what_the_environment_exports(commit, result)
        else:
            scope = result.continued(episodes)
            commits = await commit(scope)
        manifest = await publish_checkpoint(
            root,
            checkpoint_id,
            coordinator.members,
            commits,
            scope,
            controller_state,
            fault=fault,
            traceparent=traceparent,
        )
    except Exception:
        # The original failure is the one the caller must see; resume is safe to repeat later.
        with contextlib.suppress(CoordinationError):
            await _resume_quietly(coordinator, checkpoint_id)
        with contextlib.suppress(OSError):
            await anyio.to_thread.run_sync(_remove_unpublished, root, checkpoint_id)
        raise
    await _resume_quietly(coordinator, checkpoint_id)
    return CheckpointOutcome(checkpoint_id, result, manifest, commit.resent)
