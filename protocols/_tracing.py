"""The names of a checkpoint's trace: span names, attribute names, the propagation header.

midflight's spans carry the reference's names (``gym.checkpoint.<op>`` and the attributes under
``nemo.gym.checkpoint.``), so a dashboard or query written for the reference stack reads a
midflight trace unchanged (D317). This module is only names: the spans themselves are made where
the work happens, with the OpenTelemetry API, and cost nothing while tracing is off.

One checkpoint is one trace::

    gym.checkpoint.collection.checkpoint          the coordinator, a new root per checkpoint
    ├── gym.checkpoint.coordinate.prepare
    │   └── gym.checkpoint.coordinate.prepare.<kind>     one per stage
    │       └── gym.checkpoint.call.prepare              one client span per participant
    │           └── gym.checkpoint.prepare               the participant (its own process)
    │               ├── gym.checkpoint.wait_ready
    │               └── gym.checkpoint.generation_cut    the policy server's cut round
    │                   └── gym.checkpoint.generation_cut.worker   each inference worker
    ├── gym.checkpoint.coordinate.commit
    │   └── gym.checkpoint.call.commit → gym.checkpoint.commit
    │                                     ├── gym.checkpoint.export
    │                                     ├── gym.checkpoint.write
    │                                     └── gym.checkpoint.manifest
    ├── gym.checkpoint.coordinate.publish
    └── gym.checkpoint.coordinate.resume → … → gym.checkpoint.resume

A restore is a trace of its own, ``gym.checkpoint.collection.restore``, linked to the trace of
the checkpoint it restores (stored in ``checkpoint.json``); its participants' spans
``gym.checkpoint.restore`` have ``gym.checkpoint.read`` and ``gym.checkpoint.install`` children.
A server with several processes adds ``gym.checkpoint.shard.<message>`` spans in each shard
process under the operation that asked it.
"""

from __future__ import annotations

from typing import Final

SPAN_PREFIX: Final = "gym.checkpoint."
"""Every checkpoint span's name starts so."""

ATTRIBUTE_PREFIX: Final = "nemo.gym.checkpoint."
"""Every checkpoint attribute's name starts so."""

TRACEPARENT_HEADER: Final = "traceparent"
"""The W3C trace-context header every traced call carries."""

COLLECTION_CHECKPOINT_SPAN: Final = "gym.checkpoint.collection.checkpoint"
"""The root of one checkpoint's trace (prepare, commit, publish, resume)."""

COLLECTION_RESTORE_SPAN: Final = "gym.checkpoint.collection.restore"
"""The root of one restore's trace, linked to the checkpoint it restores."""

PUBLISH_SPAN: Final = "gym.checkpoint.coordinate.publish"
"""The coordinator writing ``checkpoint.json`` and ``LATEST``."""

WAIT_READY_SPAN: Final = "gym.checkpoint.wait_ready"
"""Under a participant's prepare: waiting for every episode to reach its boundary."""

EXPORT_SPAN: Final = "gym.checkpoint.export"
"""Under a commit: the participant exporting its parked work."""

WRITE_SPAN: Final = "gym.checkpoint.write"
"""Under a commit: writing the records file (temp, fsync, rename)."""

MANIFEST_SPAN: Final = "gym.checkpoint.manifest"
"""Under a commit: publishing the participant's manifest."""

READ_SPAN: Final = "gym.checkpoint.read"
"""Under a restore: reading and verifying the participant's records."""

INSTALL_SPAN: Final = "gym.checkpoint.install"
"""Under a restore: installing the records under their next attempts."""

GENERATION_CUT_SPAN: Final = "gym.checkpoint.generation_cut"
"""Under the policy server's prepare: one cut round over every worker."""

WORKER_CUT_SPAN: Final = "gym.checkpoint.generation_cut.worker"
"""An inference worker answering one generation-cut inventory."""

ROLLOUT_SPAN: Final = "midflight.rollout"
"""The drill's driver running one attempt of a rollout (its data-plane calls are children)."""

OPERATIONS: Final = ("prepare", "renew", "commit", "restore", "resume", "retire", "forget")
"""The control operations that get a span on the participant (status is polled, not traced)."""

_FORBIDDEN_IN_NAMES: Final = ("key", "token")
"""Collectors redact attributes so named, and no attribute of ours may hold a secret."""


def operation_span(operation: str) -> str:
    """``gym.checkpoint.<operation>``: a participant serving one control operation."""
    return SPAN_PREFIX + operation


def coordinate_span(operation: str) -> str:
    """``gym.checkpoint.coordinate.<operation>``: the coordinator driving one operation."""
    return f"{SPAN_PREFIX}coordinate.{operation}"


def stage_span(kind: str) -> str:
    """``gym.checkpoint.coordinate.prepare.<kind>``: one stage of a coordinated prepare."""
    return f"{SPAN_PREFIX}coordinate.prepare.{kind}"


def call_span(operation: str) -> str:
    """``gym.checkpoint.call.<operation>``: the coordinator's call to one participant."""
    return f"{SPAN_PREFIX}call.{operation}"


def shard_span(message_kind: str) -> str:
    """``gym.checkpoint.shard.<message>``: a shard process answering its fan-out."""
    return f"{SPAN_PREFIX}shard.{message_kind}"


def attribute(name: str) -> str:
    """The full attribute name of ``name`` (``id`` → ``nemo.gym.checkpoint.id``).

    Raises:
        ValueError: The name contains ``key`` or ``token``: collectors redact such attributes,
            and midflight never puts a secret or a token in one.
    """
    lowered = name.lower()
    if any(word in lowered for word in _FORBIDDEN_IN_NAMES):
        raise ValueError(f"attribute {name!r} names a key or token: choose another name")
    return ATTRIBUTE_PREFIX + name
