"""The server side of midflight: the building blocks every participant embeds.

- the control-plane runtime (:class:`ControlPlane`) with its phase machine, lease, idempotent
  replay, retire marks and checkpoint storage;
- the participant interface (:class:`Participant`, :class:`BaseParticipant`) and one
  implementation per kind (environment, agent, model, resources);
- the authenticated HTTP router and a participant server app;
- durable writing and verified reading of one participant's share of a checkpoint;
- the capture ledger (file-backed and in-memory) with its control routes, and the capture
  protocol of one model call (:func:`resolve_admission`, :func:`record_custody`);
- the inference worker's staging helpers, its generation-cut route
  (:func:`generation_cut_router`) and a file-backed token staging store;
- servers with several processes (:class:`ProcessFanout`, :class:`FanoutShard`).

Fault switches and kill points for tests and drills live in :mod:`participants.testing`.
"""

from ._agent.hooks import AgentSessionHooks, CounterSessionHooks, RestoredAgentSession
from ._agent.participant import AgentParticipant
from ._agent.restart_only import RestartOnlyAgentParticipant
from ._agent.session import (
    AgentPeers,
    AgentSession,
    AgentSessionState,
    AgentTaskInput,
    ResourcesSessionId,
)
from ._environment.models import EnvironmentPeers, EpisodeOutcome, SeededSession
from ._environment.participant import EnvironmentParticipant
from ._environment.steps import EpisodeSteps
from ._fanout.channel import FANOUT_SOCKET_ENV
from ._fanout.group import ProcessFanout
from ._fanout.placement import Placement, slot_of
from ._fanout.shard import FanoutShard
from ._fanout.sockets import SOCKET_OWNER_FILE, listen_private, private_socket_path
from ._http.body_limit import BodyLimit
from ._http.router import (
    authorized,
    build_routes,
    control_router,
    error_response,
    error_responses,
    install_error_envelope,
    participant_app,
)
from ._ledger.custody import record_custody, resolve_admission
from ._ledger.file import FileCaptureLedger
from ._ledger.layout import LedgerLayoutError, live_ledger_keys
from ._ledger.memory import MemoryCaptureLedger
from ._ledger.routes import ledger_control_router
from ._ledger.sqlite import SqliteCaptureLedger
from ._model.cuts import CallAborter, CutRequester, generation_cut_restart_reason
from ._model.fanout import ModelProcessFanout
from ._model.gate import ModelTicket
from ._model.participant import ModelParticipant
from ._resources.models import (
    DEFAULT_ADMISSION_WAIT_SECONDS,
    RESOURCES_MODES,
    VERIFY_MODES,
    ResourcesAdmission,
    ResourcesMode,
    ResourcesSession,
    ResourcesSessionHooks,
    VerifyMode,
)
from ._resources.participant import ResourcesParticipant
from ._runtime.clock import Clock, ManualClock
from ._runtime.collector import collector_paused
from ._runtime.kill_points import KILL_BOUNDARIES, read_kill_announcements
from ._runtime.limits import (
    OPEN_FILES_TARGET,
    OpenFileLimit,
    open_files_needed,
    raise_open_file_limit,
)
from ._runtime.participant import BaseParticipant, ChangeNotifier, Participant, Record
from ._runtime.plane import ControlPlane
from ._runtime.report import build_report
from ._runtime.settings import ControlSettings
from ._runtime.telemetry import CONTROL_EVENTS, ControlTelemetry
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
from ._tracing import (
    SERVER_TELEMETRY,
    checkpoint_span,
    continued,
    current_traceparent,
    inject_headers,
    set_checkpoint_attributes,
    tracing_on,
)

__all__ = [
    "CONTROL_EVENTS",
    "DEFAULT_ADMISSION_WAIT_SECONDS",
    "FANOUT_SOCKET_ENV",
    "KILL_BOUNDARIES",
    "OPEN_FILES_TARGET",
    "RESOURCES_MODES",
    "SERVER_TELEMETRY",
    "SOCKET_OWNER_FILE",
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
    "Clock",
    "ControlPlane",
    "ControlSettings",
    "ControlTelemetry",
    "CounterSessionHooks",
    "CutRequester",
    "EnvironmentParticipant",
    "EnvironmentPeers",
    "EpisodeOutcome",
    "EpisodeSteps",
    "FanoutShard",
    "FileCaptureLedger",
    "FileTokenStagingStore",
    "LedgerLayoutError",
    "ManualClock",
    "MemoryCaptureLedger",
    "ModelParticipant",
    "ModelProcessFanout",
    "ModelTicket",
    "OpenFileLimit",
    "Participant",
    "ParticipantCheckpoint",
    "Placement",
    "ProcessFanout",
    "Record",
    "RecordsWriter",
    "ResourcesAdmission",
    "ResourcesMode",
    "ResourcesParticipant",
    "ResourcesSession",
    "ResourcesSessionHooks",
    "ResourcesSessionId",
    "RestartOnlyAgentParticipant",
    "RestoredAgentSession",
    "RolloutTokenCapture",
    "SeededSession",
    "SqliteCaptureLedger",
    "StreamingUnsupportedError",
    "VerifyMode",
    "authorized",
    "build_report",
    "build_routes",
    "checkpoint_span",
    "collector_paused",
    "continued",
    "control_router",
    "current_traceparent",
    "error_response",
    "error_responses",
    "fsync_directory",
    "generation_cut_restart_reason",
    "generation_cut_router",
    "inject_headers",
    "install_error_envelope",
    "ledger_control_router",
    "listen_private",
    "live_ledger_keys",
    "make_directory_durable",
    "open_files_needed",
    "participant_app",
    "private_socket_path",
    "put_entries",
    "raise_open_file_limit",
    "read_kill_announcements",
    "read_participant_checkpoint",
    "rebuild_generation_cut",
    "record_custody",
    "resolve_admission",
    "set_checkpoint_attributes",
    "slot_of",
    "tracing_on",
    "write_file_durably",
]
