"""The error table and the exception tree.

Every exception midflight defines, in any of its four packages, derives from ``MidflightError``,
so ``except MidflightError`` catches whatever midflight raises of its own. Under it, ``WireError``
is the base of every refusal that travels: each has a stable wire code, an HTTP status and a
retryable flag, one class per code. The table below is the single source of truth for them; the
server turns such an exception into the envelope ``{"error": {"code", "detail"}}`` while the
client turns an envelope back into the same class. The other leaves never cross the wire: they
report a local failure, and a few keep a standard base (in parentheses) that callers catch.

Exception tree::

    MidflightError
    ├── WireError
    │   ├── UnauthorizedError                     401 unauthorized
    │   ├── InvalidRequestError                   422 invalid_request
    │   ├── InvalidCheckpointStateError           422 invalid_checkpoint_state
    │   ├── RolloutIdRequiredError                400 rollout_id_required
    │   ├── InvalidRolloutIdError                 400 invalid_rollout_id
    │   ├── StaleCheckpointError                  409 stale_checkpoint
    │   ├── CheckpointConflictError               409 checkpoint_conflict
    │   ├── InvalidPhaseError                     409 invalid_phase
    │   ├── DeadlineExceededError                 409 deadline_exceeded                  retryable
    │   ├── AdmissionClosedError                  409 admission_closed                   retryable
    │   ├── StaleAttemptError                     409 stale_attempt
    │   ├── RestartInScopeError                   409 restart_in_scope
    │   ├── RetireIncompleteError                 409 retire_incomplete                  retryable
    │   ├── ActivationOutOfOrderError             409 activation_out_of_order
    │   ├── CheckpointOpenError                   409 checkpoint_open                    retryable
    │   ├── CheckpointError                       409 checkpoint_error
    │   ├── RolloutRetiredError                   410 rollout_retired
    │   ├── RequestTooLargeError                  413 request_too_large
    │   ├── CheckpointCoordinatorUnavailableError 503 checkpoint_coordinator_unavailable retryable
    │   └── InternalError                         500 internal_error                     retryable
    ├── CaptureError                              participants: the capture lifecycle was broken
    │   └── StreamingUnsupportedError             participants: staging takes whole responses
    ├── LedgerLayoutError (RuntimeError)          participants: a ledger directory holds the other layout
    ├── CoordinationError                         coordinator: an operation failed on some servers
    ├── NotAParticipantError                      coordinator: the status route answered 404
    ├── PublicationConflictError                  coordinator: another publication got to the store first
    │   ├── CheckpointTakenError                  coordinator: the id's checkpoint.json holds another one
    │   └── LatestMovedError                      coordinator: another publisher moved LATEST first
    ├── StoreError (OSError)                      protocols: a checkpoint store request failed
    │   └── ObjectMissingError (FileNotFoundError) protocols: the key names no object
    ├── ContinuationRefused                       e2e: the worker refused a generation cut
    ├── DrillRunError (RuntimeError)              e2e: the drill could not run to its figures
    │   ├── DrillBaselineError                    e2e: the baseline did not finish every rollout
    │   └── DrillStalledError                     e2e: the drill stopped making progress
    ├── EngineError (ValueError)                  e2e: an engine unknown or not installed
    ├── PortInUseError (OSError)                  e2e: a serve port is taken or not permitted
    └── TokenSequenceError (ValueError)           e2e: a manifest's token chain does not hold

``tests/test_error_tree.py`` imports every module of the four packages and fails when an exception
class does not derive from ``MidflightError`` or when this drawing (or the one in
``docs/errors.md``) disagrees with the classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """One row of the error table.

    Attributes:
        code: The wire string in ``{"error": {"code": ...}}``.
        http_status: The HTTP status the server answers with.
        retryable: Whether a client may retry the same call (with the same checkpoint id).
        meaning: When the code is used, in one sentence.
    """

    code: str
    http_status: int
    retryable: bool
    meaning: str


ERROR_TABLE: Final[tuple[ErrorSpec, ...]] = (
    ErrorSpec(
        "unauthorized", 401, False, "missing or wrong bearer token (checked before the body)"
    ),
    ErrorSpec(
        "invalid_request",
        422,
        False,
        "body or parameters fail validation, including a deadline_ts too far ahead",
    ),
    ErrorSpec(
        "invalid_checkpoint_state",
        422,
        False,
        "manifest or records missing, corrupt, of another kind or instance, already holding a "
        "different commit, or an I/O error",
    ),
    ErrorSpec("rollout_id_required", 400, False, "work without a rollout id"),
    ErrorSpec(
        "invalid_rollout_id", 400, False, "a malformed rollout id or capture key; nothing changed"
    ),
    ErrorSpec("stale_checkpoint", 409, False, "the checkpoint id was resumed or its lease expired"),
    ErrorSpec(
        "checkpoint_conflict",
        409,
        False,
        "another checkpoint is active, or a retry names another directory or scope",
    ),
    ErrorSpec(
        "invalid_phase",
        409,
        False,
        "wrong phase, readiness regressed before commit, or retire/forget while a checkpoint is open",
    ),
    ErrorSpec(
        "deadline_exceeded", 409, True, "the deadline passed before or during I/O; retry, same id"
    ),
    ErrorSpec(
        "admission_closed", 409, True, "new work while a checkpoint is open; retry after resume"
    ),
    ErrorSpec("stale_attempt", 409, False, "a request of a retired or fenced attempt"),
    ErrorSpec("restart_in_scope", 409, False, "a commit scope names a reported restart"),
    ErrorSpec(
        "retire_incomplete",
        409,
        True,
        "forget before the retired state is freed; retire again first",
    ),
    ErrorSpec(
        "activation_out_of_order",
        409,
        False,
        "agent activation index neither the last completed nor the next",
    ),
    ErrorSpec(
        "checkpoint_open",
        409,
        True,
        "ledger retire or delete while a checkpoint is open on that model server",
    ),
    ErrorSpec(
        "checkpoint_error",
        409,
        False,
        "any other refusal of a control operation (different task, restore into a live process)",
    ),
    ErrorSpec("rollout_retired", 410, False, "the ledger manifest of a retired rollout"),
    ErrorSpec(
        "request_too_large",
        413,
        False,
        "a request body over the server's limit, refused before it is parsed; nothing changed",
    ),
    ErrorSpec("checkpoint_coordinator_unavailable", 503, True, "a server's worker link is down"),
    ErrorSpec("internal_error", 500, True, "a bug; never the answer to bad input"),
)

ERRORS_BY_CODE: Final = MappingProxyType({spec.code: spec for spec in ERROR_TABLE})


class MidflightError(Exception):
    """Root of every exception midflight defines.

    Catch it to handle anything midflight raises of its own. Only its ``WireError`` branch has a
    wire form; the other branches are local failures (see the tree in this module's docstring).
    """


class WireError(MidflightError):
    """Root of every error that has a wire code.

    Args:
        detail: A human-readable explanation; it travels as ``error.detail``.
    """

    spec: ClassVar[ErrorSpec]

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def code(self) -> str:
        """The wire code."""
        return self.spec.code

    @property
    def http_status(self) -> int:
        """The HTTP status the server answers with."""
        return self.spec.http_status

    @property
    def retryable(self) -> bool:
        """Whether the same call may be retried."""
        return self.spec.retryable

    def envelope(self) -> dict[str, dict[str, str]]:
        """The JSON body a server sends for this error."""
        return {"error": {"code": self.code, "detail": self.detail}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


def _spec(code: str) -> ErrorSpec:
    return ERRORS_BY_CODE[code]


class UnauthorizedError(WireError):
    """Missing or wrong bearer token."""

    spec = _spec("unauthorized")


class InvalidRequestError(WireError):
    """The body or parameters fail validation."""

    spec = _spec("invalid_request")


class InvalidCheckpointStateError(WireError):
    """A manifest or records file is missing, corrupt, foreign or conflicting, or I/O failed."""

    spec = _spec("invalid_checkpoint_state")


class RolloutIdRequiredError(WireError):
    """Work arrived without a rollout id."""

    spec = _spec("rollout_id_required")


class InvalidRolloutIdError(WireError):
    """A rollout id or capture key is malformed; nothing was changed."""

    spec = _spec("invalid_rollout_id")


class StaleCheckpointError(WireError):
    """The checkpoint id was already resumed, or its lease expired."""

    spec = _spec("stale_checkpoint")


class CheckpointConflictError(WireError):
    """Another checkpoint is active, or a retry changed its arguments."""

    spec = _spec("checkpoint_conflict")


class InvalidPhaseError(WireError):
    """The operation is not allowed in the participant's current phase."""

    spec = _spec("invalid_phase")


class DeadlineExceededError(WireError):
    """The deadline passed before or during I/O; retry with the same id."""

    spec = _spec("deadline_exceeded")


class AdmissionClosedError(WireError):
    """New work while a checkpoint is open; retry after resume."""

    spec = _spec("admission_closed")


class StaleAttemptError(WireError):
    """A request of a retired or fenced attempt."""

    spec = _spec("stale_attempt")


class RestartInScopeError(WireError):
    """A commit scope names an episode the participant reported as a restart."""

    spec = _spec("restart_in_scope")


class RetireIncompleteError(WireError):
    """Forget named a rollout whose retired state is not freed yet."""

    spec = _spec("retire_incomplete")


class ActivationOutOfOrderError(WireError):
    """An agent activation index is neither the last completed one nor the next."""

    spec = _spec("activation_out_of_order")


class CheckpointOpenError(WireError):
    """Ledger retire or delete while a checkpoint is open on the model server."""

    spec = _spec("checkpoint_open")


class CheckpointError(WireError):
    """Any other refusal of a control operation."""

    spec = _spec("checkpoint_error")


class RolloutRetiredError(WireError):
    """The ledger of a retired rollout was asked for."""

    spec = _spec("rollout_retired")


class RequestTooLargeError(WireError):
    """A request body is over the server's limit; it was refused before being parsed."""

    spec = _spec("request_too_large")


class CheckpointCoordinatorUnavailableError(WireError):
    """A multi-worker server's link to its coordinator is down."""

    spec = _spec("checkpoint_coordinator_unavailable")


class InternalError(WireError):
    """A bug. Never the answer to bad input."""

    spec = _spec("internal_error")


ERROR_CLASSES: Final = MappingProxyType({cls.spec.code: cls for cls in WireError.__subclasses__()})


def error_from_envelope(status: int, body: Any) -> WireError:
    """Turn an error reply back into its exception.

    Args:
        status: The HTTP status of the reply.
        body: The parsed JSON body, expected to be ``{"error": {"code", "detail"}}``.

    Returns:
        The exception of the code; an ``InternalError`` naming the status when the body is not an
        envelope or the code is unknown, so a client never loses the reply.
    """
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code, detail = error.get("code"), error.get("detail", "")
        cls = ERROR_CLASSES.get(code) if isinstance(code, str) else None
        if cls is not None:
            return cls(detail if isinstance(detail, str) else str(detail))
    return InternalError(f"HTTP {status} without a known error envelope: {body!r}"[:2000])
