"""Each package's public surface is pinned: a name that leaks or goes missing fails here.

When you add a public name on purpose, add it to the list below in the same commit.
"""

from __future__ import annotations

import importlib
import re

import pytest

PUBLIC = {
    "protocols": [
        "ALLOWED_PHASES", "CONTROL_PREFIX", "CONTROL_ROUTES", "COORDINATION_REPLY_SLACK_SECONDS",
        "DEFAULT_LEASE_GRACE_SECONDS", "DEFAULT_MAX_DEADLINE_SECONDS", "ERRORS_BY_CODE",
        "ERROR_CLASSES", "ERROR_TABLE", "FINGERPRINT_VERSION", "LEDGER_CONTROL_PREFIX",
        "LEDGER_ROW_MISSING_CHAIN_HASH_REASON", "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
        "MANIFEST_CORE_FIELDS", "MANIFEST_FILE", "MANIFEST_SCHEMA_VERSION",
        "MAX_CHECKPOINT_ID_LENGTH", "MAX_LEDGER_BATCH", "MAX_REPORTED_BLOCKERS", "OPEN_PHASES",
        "PARTICIPANTS_SUBDIR", "PARTICIPANT_KINDS", "PHASE_TRANSITIONS", "POISON_REASONS",
        "PREPARE_ORDER", "RECORDS_FILE_PATTERN", "RESTORE_CLEANUP_MIN_SECONDS",
        "RESUMED_IDS_REMEMBERED", "RESUME_ORDER", "RETIRE_ORDER", "SAFE_NAME_PATTERN",
        "ActivationOutOfOrderError", "AdmissionClosedError", "CallRecord", "CaptureLedger",
        "CaptureLedgerCommit", "CheckpointConflictError", "CheckpointCoordinatorUnavailableError",
        "CheckpointError", "CheckpointId", "CheckpointOpenError", "CheckpointRequest",
        "CommitReply", "CommitRequest", "CustodyRow", "DeadlineExceededError", "DeadlineTs",
        "EpisodeId", "ErrorDetail", "ErrorEnvelope", "ErrorSpec", "FailureRow", "ForgetReply",
        "ForgetRequest", "InstanceName", "InternalError", "InvalidCheckpointStateError",
        "InvalidPhaseError", "InvalidRequestError", "InvalidRolloutIdError", "LedgerBatchRequest",
        "LineageMatch", "LineageOnlyRow", "LineageResolution", "ManifestFailure",
        "MidflightError", "ParticipantKind", "ParticipantManifest", "Phase", "PhaseEvent",
        "PrepareReply", "PrepareReport", "RenewReply", "RequestItem", "RequestItems",
        "RestartInScopeError", "RestoreReply", "RestoreRequest", "ResumeReply",
        "RetireIncompleteError", "RetireReply", "RetireRequest", "RolloutId",
        "RolloutIdRequiredError", "RolloutManifest", "RolloutRemoval", "RolloutRetiredError",
        "StaleAttemptError", "StaleCheckpointError", "StatusReply", "ToolCallItem",
        "UnauthorizedError", "as_request_items", "assistant_fingerprint", "build_manifest",
        "capture_key", "conversation_digest", "custody_row", "decode_record_line", "dump_wire",
        "encode_record_line", "encode_row", "error_from_envelope", "failure_row",
        "is_records_file_name", "manifest_from_rows", "next_phase", "participant_directory",
        "records_file_name", "resolve_explicit_rows", "resolve_rows", "serialize_manifest",
        "sorted_capture_keys", "task_digest", "validate_checkpoint_id", "validate_ledger_key",
        "validate_ledger_keys", "validate_rollout_id", "validate_rollout_ids", "validate_row",
        "validate_safe_name",
    ],
    "participants": [
        "CAPTURE_FILE_SUFFIXES", "DEFAULT_MAX_CACHED_ROLLOUTS", "DEFAULT_MAX_CACHED_ROWS",
        "DEFAULT_STRIPES", "LOCK_DIRECTORY", "RETIRE_STEPS", "WRITE_STEPS", "FileCaptureLedger",
        "LedgerCacheCollector", "MemoryCaptureLedger", "ParticipantCheckpoint", "RecordsWriter",
        "RowCache", "fsync_directory", "ledger_control_router", "make_directory_durable",
        "read_participant_checkpoint", "write_file_durably",
    ],
    "coordinator": ["LedgerClient"],
    "e2e": ["build_app", "main"],
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
