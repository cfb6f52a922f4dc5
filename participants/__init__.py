"""The server side of midflight: the building blocks every participant embeds.

- the control-plane runtime (:class:`ControlPlane`) with its phase machine, lease, idempotent
  replay, retire marks and checkpoint storage;
- the participant interface (:class:`Participant`, :class:`BaseParticipant`);
- the authenticated HTTP router and a participant server app;
- durable writing and verified reading of one participant's share of a checkpoint;
- the capture protocol of one model call (:func:`resolve_admission`, :func:`record_custody`);
- the inference worker's staging helpers, its generation-cut route
  (:func:`generation_cut_router`) and a file-backed token staging store.
So far: durable writing and verified reading of one participant's share of a checkpoint, and
the capture ledger (file-backed and in-memory) with its control routes.
"""

from ._agent.hooks import AgentSessionHooks, CounterSessionHooks, RestoredAgentSession
from ._agent.participant import AgentParticipant
from ._agent.restart_only import RestartOnlyAgentParticipant
from ._agent.session import AgentPeers, AgentSession, AgentSessionState, AgentTaskInput, choose_tool
from ._environment.models import (
    EnvironmentPeers,
    EnvironmentRecord,
    EpisodeOutcome,
    SeededSession,
)
from ._environment.participant import EnvironmentParticipant
from ._environment.steps import EpisodeSteps, TrackedEpisode
from ._fanout.channel import (
    FANOUT_SOCKET_ENV,
    FRAME_MAX_BYTES,
    MESSAGE_TIMEOUT_SECONDS,
    REPLY_GRACE_SECONDS,
    Channel,
)
from ._fanout.group import ProcessFanout
from ._fanout.placement import Placement, slot_of
from ._fanout.roster import ShardState
from ._fanout.shard import REPORT_POLL_SECONDS, FanoutShard
from ._fanout.sockets import (
    SOCKET_OWNER_FILE,
    listen_private,
    private_socket_path,
    remove_stale_socket_dirs,
)
from ._http.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from ._http.router import (
    authorized,
    control_router,
    describe_validation_error,
    error_response,
    error_responses,
    install_error_envelope,
    participant_app,
)
from ._ledger.cache import (
    DEFAULT_MAX_CACHED_ROLLOUTS,
    DEFAULT_MAX_CACHED_ROWS,
    LedgerCacheCollector,
    RowCache,
)
from ._ledger.common import CAPTURE_FILE_SUFFIXES
from ._ledger.custody import record_custody, resolve_admission
from ._ledger.file import FileCaptureLedger
from ._ledger.locks import DEFAULT_STRIPES, LOCK_DIRECTORY
from ._ledger.memory import MemoryCaptureLedger
from ._ledger.removal import RETIRE_STEPS
from ._ledger.routes import ledger_control_router
from ._model.cuts import CutRequester, generation_cut_restart_reason
from ._model.fanout import ModelProcessFanout
from ._model.gate import ModelTicket
from ._model.participant import MODEL_FAULTS, CallAborter, ModelParticipant
from ._resources.models import (
    DEFAULT_ADMISSION_WAIT_SECONDS,
    RESOURCES_MODES,
    VERIFY_MODES,
    ResourcesAdmission,
    ResourcesMode,
    ResourcesRoute,
    ResourcesSession,
    ResourcesSessionHooks,
    VerifyMode,
)
from ._resources.participant import ResourcesParticipant
from ._runtime.clock import Clock, ManualClock, SystemClock
from ._runtime.jobs import Job
from ._runtime.kill_points import (
    KILL_BOUNDARIES,
    KILL_FILE_ENV,
    KILL_POINT_ENV,
    TEST_HOOKS_ENV,
    KillPoint,
    read_kill_announcements,
)
from ._runtime.marks import RetireMarks
from ._runtime.participant import BaseParticipant, ChangeNotifier, Participant, Record
from ._runtime.plane import ControlPlane
from ._runtime.report import build_report
from ._runtime.settings import ControlSettings
from ._runtime.telemetry import (
    CONTROL_EVENTS,
    GENERATION_CUT_OUTCOMES,
    ControlTelemetry,
    GenerationCutTelemetry,
)
from ._staging.calls import RolloutTokenCapture
from ._staging.cut_router import generation_cut_router
from ._staging.errors import CaptureError, StreamingUnsupportedError
from ._staging.prefix import rebuild_generation_cut
from ._staging.records import ActiveCall, CaptureAdapter
from ._staging.store import FileTokenStagingStore, put_entries
from ._storage.checkpoint_store import (
    WRITE_STEPS,
    ParticipantCheckpoint,
    RecordsWriter,
    read_participant_checkpoint,
)
from ._storage.durable import fsync_directory, make_directory_durable, write_file_durably

__all__ = [
    "CAPTURE_FILE_SUFFIXES",
    "CONTROL_EVENTS",
    "DEFAULT_ADMISSION_WAIT_SECONDS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CACHED_ROLLOUTS",
    "DEFAULT_MAX_CACHED_ROWS",
    "DEFAULT_STRIPES",
    "FANOUT_SOCKET_ENV",
    "FRAME_MAX_BYTES",
    "GENERATION_CUT_OUTCOMES",
    "KILL_BOUNDARIES",
    "KILL_FILE_ENV",
    "KILL_POINT_ENV",
    "LOCK_DIRECTORY",
    "MESSAGE_TIMEOUT_SECONDS",
    "MODEL_FAULTS",
    "REPLY_GRACE_SECONDS",
    "REPORT_POLL_SECONDS",
    "RESOURCES_MODES",
    "RETIRE_STEPS",
    "SOCKET_OWNER_FILE",
    "TEST_HOOKS_ENV",
    "VERIFY_MODES",
    "WRITE_STEPS",
    "ActiveCall",
    "AgentParticipant",
    "AgentPeers",
    "AgentSession",
    "AgentSessionHooks",
    "AgentSessionState",
    "AgentTaskInput",
    "BaseParticipant",
    "BodyLimit",
    "CallAborter",
    "CaptureAdapter",
    "CaptureError",
    "ChangeNotifier",
    "Channel",
    "Clock",
    "ControlPlane",
    "ControlSettings",
    "ControlTelemetry",
    "CounterSessionHooks",
    "CutRequester",
    "EnvironmentParticipant",
    "EnvironmentPeers",
    "EnvironmentRecord",
    "EpisodeOutcome",
    "EpisodeSteps",
    "FanoutShard",
    "FileCaptureLedger",
    "FileTokenStagingStore",
    "GenerationCutTelemetry",
    "Job",
    "KillPoint",
    "LedgerCacheCollector",
    "ManualClock",
    "MemoryCaptureLedger",
    "ModelParticipant",
    "ModelProcessFanout",
    "ModelTicket",
    "Participant",
    "ParticipantCheckpoint",
    "Placement",
    "ProcessFanout",
    "Record",
    "RecordsWriter",
    "ResourcesAdmission",
    "ResourcesMode",
    "ResourcesParticipant",
    "ResourcesRoute",
    "ResourcesSession",
    "ResourcesSessionHooks",
    "RestartOnlyAgentParticipant",
    "RestoredAgentSession",
    "RetireMarks",
    "RolloutTokenCapture",
    "RowCache",
    "SeededSession",
    "ShardState",
    "StreamingUnsupportedError",
    "SystemClock",
    "TrackedEpisode",
    "VerifyMode",
    "authorized",
    "build_report",
    "choose_tool",
    "control_router",
    "describe_validation_error",
    "error_response",
    "error_responses",
    "fsync_directory",
    "generation_cut_restart_reason",
    "generation_cut_router",
    "install_error_envelope",
    "ledger_control_router",
    "listen_private",
    "make_directory_durable",
    "participant_app",
    "private_socket_path",
    "put_entries",
    "read_kill_announcements",
    "read_participant_checkpoint",
    "rebuild_generation_cut",
    "record_custody",
    "remove_stale_socket_dirs",
    "resolve_admission",
    "slot_of",
    "write_file_durably",
]
