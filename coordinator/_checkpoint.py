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

from pydantic import JsonValue

from protocols import RESTORE_CLEANUP_MIN_SECONDS, EpisodeId

from ._drivers import CoordinationError, Coordinator, PrepareResult
from ._publish import CheckpointManifest, checkpoint_directory, publish_checkpoint


@dataclass(frozen=True)
class CheckpointOutcome:
    """What :func:`checkpoint` did.

    Attributes:
        checkpoint_id: The id used on every call (also on every retry).
        prepare: The prepare result (its blockers, restarts and continued scope).
        manifest: The published ``checkpoint.json``, or ``None`` when blockers remained.
    """

    checkpoint_id: str
    prepare: PrepareResult
    manifest: CheckpointManifest | None

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


async def checkpoint(
    coordinator: Coordinator,
    root: Path,
    checkpoint_id: str,
    *,
    deadline_seconds: float,
    episodes: Sequence[EpisodeId] | None = None,
    controller_state: JsonValue = None,
    fault: str | None = None,
) -> CheckpointOutcome:
    """Take one checkpoint across every participant and publish it under ``root``.

    Args:
        coordinator: The participants.
        root: The run root (the checkpoint goes to ``<root>/checkpoints/<id>``).
        checkpoint_id: The checkpoint's id; retries reuse it.
        deadline_seconds: How long prepare, commit and publication may take in all.
        episodes: The episodes to continue, or ``None`` for everything the environment exports.
        controller_state: The controller's own state, published in ``checkpoint.json``.
        fault: A test-only publication fault (see ``PUBLISH_FAULTS``).

    Returns:
        The outcome; ``manifest`` is ``None`` when some participant stayed blocked (everyone has
        been resumed; retire ``blocking_episodes()`` and dispatch them again).

    Raises:
        CoordinationError: A participant failed (everyone was resumed before raising).
        InvalidCheckpointStateError: Publication found a missing or changed manifest.
    """
    deadline = time.time() + deadline_seconds
    directory = checkpoint_directory(root, checkpoint_id)
    try:
        result = await coordinator.prepare(checkpoint_id, deadline)
        if not result.prepared:
            await _resume_quietly(coordinator, checkpoint_id)
            return CheckpointOutcome(checkpoint_id, result, None)
        scope = None if episodes is None else result.continued(episodes)
        commits = await coordinator.commit(checkpoint_id, deadline, str(directory), scope)
        if scope is None:
            kinds = {member.instance: member.kind for member in coordinator.members}
            exported = {
                key
                for name, reply in commits.items()
                if kinds[name] == "environment"
                for key in reply.episode_ids
            }
            scope = result.continued(EpisodeId.from_capture_key(key) for key in sorted(exported))
        manifest = await publish_checkpoint(
            root,
            checkpoint_id,
            coordinator.members,
            commits,
            scope,
            controller_state,
            fault=fault,
        )
    except Exception:
        # The original failure is the one the caller must see; resume is safe to repeat later.
        with contextlib.suppress(CoordinationError):
            await _resume_quietly(coordinator, checkpoint_id)
        raise
    await _resume_quietly(coordinator, checkpoint_id)
    return CheckpointOutcome(checkpoint_id, result, manifest)
