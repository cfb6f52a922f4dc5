"""Each package's public surface is pinned: a name that leaks or goes missing fails here.

When you add a public name on purpose, add it to the list below in the same commit.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PUBLIC = {
    "protocols": [
        "ABORT_CALLS_PATH", "ALLOWED_PHASES", "CONTROL_PREFIX",
        "COORDINATION_REPLY_SLACK_SECONDS", "DEFAULT_LEASE_GRACE_SECONDS",
        "DEFAULT_MAX_DEADLINE_SECONDS", "ERRORS_BY_CODE", "ERROR_TABLE",
        "GENERATION_CUT_PATH", "LEDGER_CONTROL_PREFIX", "MANIFEST_FILE",
        "MAX_ATTEMPT", "MAX_COMPLETION_TOKENS", "MAX_LEDGER_BATCH", "MAX_REPORTED_BLOCKERS",
        "PHASE_TRANSITIONS", "PREPARE_ORDER", "RESTORE_CLEANUP_MIN_SECONDS",
        "RESUMED_IDS_REMEMBERED", "RESUME_ORDER", "RETIRE_ORDER", "VERIFIED_INVENTORY",
        "AbortCallsReply",
        "AbortCallsRequest", "ActivationOutOfOrderError", "AdmissionClosedError",
        "CallRecord", "CaptureAdmission", "CaptureLedger", "CaptureLedgerCommit",
        "CheckpointConflictError", "CheckpointCoordinatorUnavailableError", "CheckpointStore",
        "ObjectMissingError", "S3_SCHEME", "StoreError", "StoredObject", "fsync_directory",
        "is_object_store_url", "key_under", "make_directory_durable", "open_store",
        "split_s3_url", "store_key", "write_file_durably",
        "CheckpointError", "CheckpointOpenError", "CheckpointRequest", "CommitCoords",
        "CommitReply", "CommitRequest", "CompletionReply", "CompletionRequest", "EncodedColumns",
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
        "RolloutRetiredError", "StagedCallRecord", "StagedEntry", "StagedPrefix", "StaleAttemptError",
        "StaleCheckpointError", "StatusReply", "TokenStagingStore", "UnauthorizedError",
        "WireError", "admission_from_resolution", "as_request_items", "attempts_through",
        "build_manifest",
        "capture_key", "commit_coords_problem", "compute_chain_hash", "conversation_digest",
        "custody_commit", "custody_row", "decode", "decode_json", "decode_record_line", "dump_wire",
        "encode", "encode_record_line", "encode_row", "encode_wire", "error_from_envelope", "failure_row",
        "generation_cut_staging_key", "hash_token_ids", "inventory_digest",
        "is_records_file_name", "keys_covered_by", "manifest_from_rows", "next_phase",
        "participant_directory",
        "refuse_unrestorable", "render_prompt", "resolve_explicit_rows", "resolve_rows", "root_call_hashes", "serialize_manifest",
        "sorted_capture_keys", "staging_key", "task_digest", "validate_checkpoint_id",
        "validate_ledger_key", "validate_ledger_keys", "validate_rollout_ids",
        "validate_row", "validate_safe_name",
        # the names of a checkpoint's trace (D317)
        "ATTRIBUTE_PREFIX", "COLLECTION_CHECKPOINT_SPAN", "COLLECTION_RESTORE_SPAN",
        "EXPORT_SPAN", "GENERATION_CUT_SPAN", "INSTALL_SPAN", "MANIFEST_SPAN", "OPERATIONS",
        "PUBLISH_SPAN", "READ_SPAN", "ROLLOUT_SPAN", "SPAN_PREFIX", "TRACEPARENT_HEADER",
        "WAIT_READY_SPAN", "WORKER_CUT_SPAN", "WRITE_SPAN", "attribute", "call_span",
        "coordinate_span", "operation_span", "shard_span", "stage_span",
    ],
    "participants": [
        "CONTROL_EVENTS", "DEFAULT_ADMISSION_WAIT_SECONDS", "FANOUT_SOCKET_ENV",
        "KILL_BOUNDARIES", "RESOURCES_MODES", "SOCKET_OWNER_FILE", "VERIFY_MODES",
        "WRITE_STEPS", "ActiveCall", "AgentParticipant", "AgentPeers", "AgentSession",
        "AgentSessionHooks", "AgentSessionState", "AgentTaskInput", "BaseParticipant",
        "BodyLimit", "CallAborter", "CaptureAdapter", "CaptureError", "ChangeNotifier",
        "Clock", "ControlPlane", "ControlSettings", "ControlTelemetry",
        "CounterSessionHooks", "CutRequester", "EnvironmentParticipant", "EnvironmentPeers",
        "EpisodeOutcome", "EpisodeSteps", "FanoutShard", "FileCaptureLedger",
        "FileTokenStagingStore", "LedgerLayoutError", "ManualClock", "MemoryCaptureLedger",
        "ModelParticipant",
        "ModelProcessFanout", "ModelTicket", "Participant", "ParticipantCheckpoint",
        "Placement", "ProcessFanout", "Record", "RecordsWriter", "ResourcesAdmission",
        "ResourcesMode", "ResourcesParticipant", "ResourcesSession",
        "ResourcesSessionHooks", "ResourcesSessionId", "RestartOnlyAgentParticipant", "RestoredAgentSession",
        "RolloutTokenCapture", "SeededSession", "SqliteCaptureLedger",
        "StreamingUnsupportedError", "VerifyMode",
        "authorized", "build_report", "build_routes", "collector_paused", "control_router", "error_response", "error_responses",
        "fsync_directory", "generation_cut_restart_reason", "generation_cut_router",
        "install_error_envelope", "ledger_control_router", "listen_private",
        "live_ledger_keys",
        "make_directory_durable", "participant_app", "private_socket_path", "put_entries",
        "read_kill_announcements", "read_participant_checkpoint", "rebuild_generation_cut",
        "record_custody", "resolve_admission", "slot_of", "write_file_durably",
        # server-side tracing (D318, D321)
        "SERVER_TELEMETRY", "checkpoint_span", "continued", "current_traceparent",
        "inject_headers", "set_checkpoint_attributes", "tracing_on",
        # the open-file limit of a server carrying thousands in flight (D387)
        "OPEN_FILES_TARGET", "OpenFileLimit", "open_files_needed", "raise_open_file_limit",
    ],
    "coordinator": [
        "CHECKPOINTS_SUBDIR", "CHECKPOINT_FILE", "LATEST_FILE", "CheckpointManifest",
        "CheckpointOutcome", "ControlClient", "CoordinationError", "Coordinator",
        "GcReport", "LedgerClient", "Member", "NotAParticipantError", "PrepareResult",
        "PublishedParticipant", "checkpoint", "checkpoint_directory", "collect_garbage",
        "discover", "pin_checkpoint", "publish_checkpoint", "read_checkpoint",
        "read_latest", "unpin_checkpoint", "verify_checkpoint",
        "CheckpointTrace", "checkpoint_trace",  # one checkpoint, one trace (D320)
        # a run root on a store: the location to send, two publications that collide (D332)
        "CheckpointTakenError", "LatestMovedError", "PublicationConflictError",
        "checkpoint_location",
        # the participants hosted on Ray, found from Ray (D338)
        "DESCRIBE_METHOD", "HostedServer", "discover_on_ray", "hosted_on_ray",
        "is_pinned",  # what `pin` tells its user it changed (D367)
        "IDLE_CONNECTION_EXPIRY_S",  # one figure for every client's idle connections (D375)
        "send_while_out_of_time",  # one resend rule for commit, retire and resume (D392)
        "http_transport",  # httpcore's pool with a linear pass that spares held connections (D381)
        "HttpClient",  # replies freed without the cyclic garbage collector (D414)
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


ROOT = Path(__file__).resolve().parents[1]


def _words(paths: list[Path]) -> set[str]:
    return {word for path in paths for word in re.findall(r"\w+", path.read_text())}


def _source(*packages: str) -> list[Path]:
    return [path for package in packages for path in (ROOT / package).rglob("*.py")]


USERS = {
    # protocols is the contract of the two library packages as well as of the reference servers.
    "protocols": ("participants", "coordinator", "e2e"),
    "participants": ("e2e",),
    "coordinator": ("e2e",),
}


@pytest.mark.parametrize("package", sorted(USERS))
def test_every_public_name_is_used_by_the_docs_or_the_reference_deployment(package: str) -> None:
    pages = [p for p in (ROOT / "docs").rglob("*.md") if p.name != "decisions.md"]
    used = _words(pages + list((ROOT / "docs").rglob("*.py")) + _source(*USERS[package]))
    unused = sorted(set(importlib.import_module(package).__all__) - used)
    assert not unused, f"{package} exports names no page and no user of it names: {unused}"


@pytest.mark.parametrize("package", ["participants", "coordinator"])
def test_test_hooks_are_importable_only_from_testing(package: str) -> None:
    testing = importlib.import_module(f"{package}.testing")
    public = set(importlib.import_module(package).__all__)
    assert testing.__all__, f"{package}.testing exports nothing"
    assert not public & set(testing.__all__), "a test hook is in the curated surface too"
    for name in testing.__all__:
        assert hasattr(testing, name)
