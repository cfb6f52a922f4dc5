"""Each package's public surface is pinned: a name that leaks or goes missing fails here.

When you add a public name on purpose, add it to the list below in the same commit.
"""

from __future__ import annotations

import importlib
import re

import pytest

PUBLIC = {
    "protocols": [
        "ALLOWED_PHASES", "CHAT_ROLES", "CONTROL_PREFIX", "CONTROL_ROUTES",
        "COORDINATION_REPLY_SLACK_SECONDS", "DEFAULT_LEASE_GRACE_SECONDS",
        "DEFAULT_MAX_DEADLINE_SECONDS", "EMPTY_EXTRAS_DIGEST", "ERRORS_BY_CODE",
        "ERROR_CLASSES", "ERROR_TABLE", "EXTRAS_DIGEST_VERSION", "FINGERPRINT_VERSION",
        "GENERATION_CUT_KEY_PREFIX", "GENERATION_PROMPT", "LEDGER_CONTROL_PREFIX",
        "LEDGER_ROW_MISSING_CHAIN_HASH_REASON", "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
        "MANIFEST_CORE_FIELDS", "MANIFEST_FILE", "MANIFEST_SCHEMA_VERSION", "MAX_ATTEMPT",
        "MAX_CHECKPOINT_ID_LENGTH", "MAX_COMPLETION_TOKENS", "MAX_LEDGER_BATCH",
        "MAX_LEDGER_KEY_LENGTH", "MAX_REPORTED_BLOCKERS", "MAX_ROLLOUT_ID_LENGTH",
        "OPEN_PHASES", "OUTPUT_ALPHABET", "PARTICIPANTS_SUBDIR", "PARTICIPANT_KINDS",
        "PHASE_TRANSITIONS", "POISON_REASONS", "PREPARE_ORDER", "RECORDS_FILE_PATTERN",
        "RESTORE_CLEANUP_MIN_SECONDS", "RESUMED_IDS_REMEMBERED", "RESUME_ORDER",
        "RETIRE_ORDER", "SAFE_NAME_PATTERN", "STAGING_DIGEST_VERSION",
        "STAGING_SCHEMA_VERSION", "AbortCallsReply", "AbortCallsRequest", "ActivationOutOfOrderError", "AdmissionClosedError",
        "CallRecord", "CaptureAdmission", "CaptureLedger", "CaptureLedgerCommit",
        "CheckpointConflictError", "CheckpointCoordinatorUnavailableError",
        "CheckpointError", "CheckpointId", "CheckpointOpenError", "CheckpointRequest",
        "CommitCoords", "CommitReply", "CommitRequest", "CompletionReply",
        "CompletionRequest", "CustodyRow", "DeadlineExceededError", "DeadlineTs",
        "EpisodeId", "ErrorDetail", "ErrorEnvelope", "ErrorSpec", "FailureRow",
        "ForgetReply", "ForgetRequest", "GenerationCutContinuation",
        "GenerationCutInventory", "GenerationCutPrefix", "GenerationCutPrefixAck",
        "GenerationCutReceipt", "GenerationCutRecord", "InstanceName", "InternalError",
        "InvalidCheckpointStateError", "InvalidPhaseError", "InvalidRequestError",
        "InvalidRolloutIdError", "LedgerBatchRequest", "LineageMatch", "LineageOnlyRow",
        "LineageResolution", "ManifestFailure", "MidflightError", "ParticipantKind",
        "ParticipantManifest", "Phase", "PhaseEvent", "PrepareReply", "PrepareReport",
        "RenewReply", "RequestItem", "RequestItems", "RequestTooLargeError", "RestartInScopeError", "RestoreReply",
        "RestoreRequest", "ResumeReply", "RetireIncompleteError", "RetireReply",
        "RetireRequest", "RolloutId", "RolloutIdRequiredError", "RolloutManifest",
        "RolloutRemoval", "RolloutRetiredError", "StagedCallRecord", "StagedEntry",
        "StaleAttemptError", "StaleCheckpointError", "StatusReply", "TokenStagingStore",
        "ToolCallItem", "UnauthorizedError", "as_request_items", "assistant_fingerprint",
        "build_manifest", "capture_key", "compute_chain_hash", "compute_extras_digest",
        "compute_staging_digest", "conversation_digest", "custody_row", "decode",
        "decode_record_line", "dump_wire", "encode", "encode_record_line", "encode_row",
        "encode_token_ids", "error_from_envelope", "failure_row", "generate_token",
        "generate_tokens", "generation_cut_staging_key", "hash_token_ids",
        "inventory_digest", "is_records_file_name", "manifest_from_rows", "next_phase",
        "participant_directory", "records_file_name", "render_message", "render_prompt",
        "resolve_explicit_rows", "resolve_rows", "serialize_manifest",
        "sorted_capture_keys", "staging_key", "task_digest", "validate_checkpoint_id",
        "validate_ledger_key", "validate_ledger_keys", "validate_rollout_id",
        "validate_rollout_ids", "validate_row", "validate_safe_name",
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
    ],
    "coordinator": [
        "CHECKPOINTS_SUBDIR", "CHECKPOINT_FILE", "DEFAULT_CONTROL_ATTEMPTS",
        "DISCOVERY_ATTEMPTS", "LATEST_FILE", "PINNED_FILE", "PUBLISH_FAULTS",
        "STATUS_TIMEOUT_SECONDS", "CheckpointManifest", "CheckpointOutcome",
        "ControlClient", "CoordinationError", "Coordinator", "GcReport", "LedgerClient",
        "Member", "NotAParticipantError", "PrepareResult", "PublishedParticipant",
        "checkpoint", "checkpoint_directory", "collect_garbage", "discover", "is_retryable",
        "pin_checkpoint", "publish_checkpoint", "publish_checkpoint_sync",
        "read_checkpoint", "read_latest", "unpin_checkpoint", "verify_checkpoint",
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
