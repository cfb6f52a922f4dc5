"""Each package's public surface is pinned: a name that leaks or goes missing fails here.

When you add a public name on purpose, add it to the list below in the same commit.
"""

from __future__ import annotations

import importlib
import re

import pytest

PUBLIC = {
    "protocols": [
        "ALLOWED_PHASES", "CONTROL_PREFIX", "COORDINATION_REPLY_SLACK_SECONDS",
        "DEFAULT_LEASE_GRACE_SECONDS", "DEFAULT_MAX_DEADLINE_SECONDS", "ERRORS_BY_CODE",
        "ERROR_TABLE", "GENERATION_CUT_PATH", "LEDGER_CONTROL_PREFIX", "MANIFEST_FILE",
        "MAX_COMPLETION_TOKENS", "MAX_LEDGER_BATCH", "MAX_REPORTED_BLOCKERS",
        "PHASE_TRANSITIONS", "PREPARE_ORDER", "RESTORE_CLEANUP_MIN_SECONDS",
        "RESUMED_IDS_REMEMBERED", "RESUME_ORDER", "RETIRE_ORDER", "AbortCallsReply",
        "AbortCallsRequest", "ActivationOutOfOrderError", "AdmissionClosedError",
        "CallRecord", "CaptureAdmission", "CaptureLedger", "CaptureLedgerCommit",
        "CheckpointConflictError", "CheckpointCoordinatorUnavailableError",
        "CheckpointError", "CheckpointOpenError", "CheckpointRequest", "CommitCoords",
        "CommitReply", "CommitRequest", "CompletionReply", "CompletionRequest",
        "DeadlineExceededError", "EpisodeId", "ErrorEnvelope", "ForgetReply",
        "ForgetRequest", "GenerationCutInventory", "GenerationCutPrefix",
        "GenerationCutPrefixAck", "GenerationCutReceipt", "GenerationCutRecord",
        "InternalError", "InvalidCheckpointStateError", "InvalidPhaseError",
        "InvalidRequestError", "InvalidRolloutIdError", "LedgerBatchRequest",
        "LineageResolution", "MidflightError", "ParticipantKind", "ParticipantManifest",
        "Phase", "PhaseEvent", "PrepareReply", "PrepareReport", "RenewReply", "RequestItem",
        "RequestItems", "RequestTooLargeError", "RestartInScopeError", "RestoreReply",
        "RestoreRequest", "ResumeReply", "RetireIncompleteError", "RetireReply",
        "RetireRequest", "RolloutIdRequiredError", "RolloutManifest", "RolloutRemoval",
        "RolloutRetiredError", "StagedCallRecord", "StagedEntry", "StaleAttemptError",
        "StaleCheckpointError", "StatusReply", "TokenStagingStore", "UnauthorizedError",
        "WireError", "admission_from_resolution", "as_request_items", "build_manifest",
        "capture_key", "commit_coords_problem", "compute_chain_hash", "conversation_digest",
        "custody_commit", "custody_row", "decode", "decode_record_line", "dump_wire",
        "encode", "encode_record_line", "encode_row", "error_from_envelope", "failure_row",
        "generation_cut_staging_key", "hash_token_ids", "inventory_digest",
        "is_records_file_name", "manifest_from_rows", "next_phase", "participant_directory",
        "render_prompt", "resolve_explicit_rows", "resolve_rows", "serialize_manifest",
        "sorted_capture_keys", "staging_key", "task_digest", "validate_checkpoint_id",
        "validate_ledger_key", "validate_ledger_keys", "validate_rollout_ids",
        "validate_row", "validate_safe_name",
    ],
    "participants": [
        "CAPTURE_FILE_SUFFIXES", "CONTROL_EVENTS", "DEFAULT_ADMISSION_WAIT_SECONDS",
        "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_CACHED_ROLLOUTS", "DEFAULT_MAX_CACHED_ROWS", "DEFAULT_STRIPES",
        "FRAME_MAX_BYTES", "GENERATION_CUT_OUTCOMES", "KILL_BOUNDARIES", "KILL_FILE_ENV",
        "KILL_POINT_ENV", "LOCK_DIRECTORY", "MESSAGE_TIMEOUT_SECONDS", "MODEL_FAULTS",
        "REPLY_GRACE_SECONDS", "REPORT_POLL_SECONDS", "RESOURCES_MODES", "RETIRE_STEPS",
        "FANOUT_SOCKET_ENV", "SOCKET_OWNER_FILE", "TEST_HOOKS_ENV", "VERIFY_MODES", "WRITE_STEPS", "ActiveCall",
        "AgentParticipant", "AgentPeers", "AgentSession", "AgentSessionHooks",
        "AgentSessionState", "AgentTaskInput", "BaseParticipant", "BodyLimit", "CaptureAdapter",
        "CallAborter", "CaptureError", "ChangeNotifier", "Channel", "Clock", "ControlPlane",
        "ControlSettings", "ControlTelemetry", "CounterSessionHooks", "CutRequester",
        "EnvironmentParticipant", "EnvironmentPeers", "EnvironmentRecord", "EpisodeOutcome",
        "EpisodeSteps", "FileCaptureLedger", "FileTokenStagingStore",
        "GenerationCutTelemetry", "Job", "KillPoint", "LedgerCacheCollector", "ManualClock",
        "MemoryCaptureLedger", "ModelProcessFanout", "ModelParticipant", "ModelTicket",
        "Participant", "ParticipantCheckpoint", "Placement", "Record", "RecordsWriter",
        "ResourcesAdmission", "ResourcesMode", "ResourcesParticipant", "ResourcesRoute",
        "ResourcesSession", "ResourcesSessionHooks", "RestartOnlyAgentParticipant",
        "RestoredAgentSession", "RetireMarks", "RolloutTokenCapture", "RowCache",
        "SeededSession", "StreamingUnsupportedError", "SystemClock", "TrackedEpisode",
        "VerifyMode", "ProcessFanout", "FanoutShard", "ShardState", "authorized",
        "build_report", "choose_tool", "control_router", "describe_validation_error",
        "error_response", "error_responses", "fsync_directory",
        "generation_cut_restart_reason", "install_error_envelope", "ledger_control_router",
        "listen_private", "make_directory_durable", "participant_app",
        "private_socket_path", "put_entries", "read_kill_announcements", "read_participant_checkpoint",
        "rebuild_generation_cut", "remove_stale_socket_dirs", "slot_of", "write_file_durably",
        "generation_cut_router", "record_custody", "resolve_admission",
    ],
    "coordinator": [
        "CHECKPOINTS_SUBDIR", "CHECKPOINT_FILE", "LATEST_FILE", "CheckpointManifest",
        "CheckpointOutcome", "ControlClient", "CoordinationError", "Coordinator",
        "GcReport", "LedgerClient", "Member", "NotAParticipantError", "PrepareResult",
        "PublishedParticipant", "checkpoint", "checkpoint_directory", "collect_garbage",
        "discover", "pin_checkpoint", "publish_checkpoint", "read_checkpoint",
        "read_latest", "unpin_checkpoint", "verify_checkpoint",
    ],
    "e2e": [
        "build_app", "main",
    ],
}  # fmt: skip


def _isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 uses: CONSTANTS, then Classes, then functions."""
    if re.fullmatch(r"[A-Z0-9_]+", name) and len(name) > 1:
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_all_is_pinned_sorted_and_importable(package: str) -> None:
    module = importlib.import_module(package)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=_isort_key), "keep __all__ sorted"
    assert sorted(exported) == sorted(PUBLIC[package])
    for name in exported:
        assert hasattr(module, name), f"{package}.{name} is in __all__ but missing"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_no_public_name_leaks_past_all(package: str) -> None:
    module = importlib.import_module(package)
    leaked = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith(f"{package}.")
        and name not in module.__all__
    }
    assert leaked == set()


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_every_package_ships_py_typed(package: str) -> None:
    from importlib.resources import files

    assert files(package).joinpath("py.typed").is_file()
