"""The controller side of midflight: what a training controller embeds.

- :class:`ControlClient`: the async client of one participant's control routes (a reserved
  connection pool, bounded calls, typed errors, retries of transport failures and retryable codes);
- :func:`discover` and :class:`Coordinator`: the fixed-order operations (prepare, commit, resume,
  restore all-or-nothing, retire, forget, renew) and :class:`PrepareResult`;
- :func:`publish_checkpoint` / :func:`read_latest`: the aggregate manifest and the ``LATEST``
  pointer, on a directory or an ``s3://`` run root (:func:`checkpoint_location`); two publishers
  that collide get a :class:`PublicationConflictError`;
- :func:`checkpoint` and :class:`CheckpointOutcome`: prepare, commit, publish and resume in one
  call, blockers handed back when a participant stays blocked;
- :func:`send_while_out_of_time`: an operation sent again, with a fresh deadline, while every
  participant that refused it ran out of time (``CoordinationError.out_of_time``);
- :func:`verify_checkpoint`, :func:`pin_checkpoint`, :func:`collect_garbage`: checking and
  clean-up of what was published;
- :class:`LedgerClient`: the client of a model server's capture-ledger routes;
- ``IDLE_CONNECTION_EXPIRY_S``: how long every midflight client keeps an idle connection (2 s, under
  any server's keep-alive), and :func:`http_transport`, the transport every midflight client
  sends through (httpcore's pool with a linear assignment pass that never closes a connection a
  request holds), for a controller that builds its own ``httpx`` clients, and :class:`HttpClient`,
  the ``httpx.AsyncClient`` whose replies leave no reference cycle for the garbage collector;
- :func:`discover_on_ray` / :func:`hosted_on_ray`: the participants hosted as named actors in a
  Ray namespace (:class:`HostedServer`, answered by each actor's ``describe``);
- :func:`checkpoint_trace`: one checkpoint as one OpenTelemetry trace, for a controller that
  drives the operations itself (:func:`checkpoint` opens it on its own).
"""

from ._checkpoint import CheckpointOutcome, checkpoint
from ._client import ControlClient, NotAParticipantError
from ._discovery import discover
from ._fixed_order import Coordinator, PrepareResult
from ._http_client import HttpClient
from ._layout import (
    CHECKPOINT_FILE,
    CHECKPOINTS_SUBDIR,
    LATEST_FILE,
    CheckpointTakenError,
    LatestMovedError,
    PublicationConflictError,
    checkpoint_directory,
    checkpoint_location,
)
from ._ledger_client import LedgerClient
from ._members import CoordinationError, Member, send_while_out_of_time
from ._pool import http_transport
from ._publish import (
    CheckpointManifest,
    PublishedParticipant,
    publish_checkpoint,
    read_checkpoint,
    read_latest,
)
from ._ray import DESCRIBE_METHOD, HostedServer, discover_on_ray, hosted_on_ray
from ._retention import GcReport, collect_garbage, is_pinned, pin_checkpoint, unpin_checkpoint
from ._retry import IDLE_CONNECTION_EXPIRY_S
from ._tracing import CheckpointTrace, checkpoint_trace
from ._verify import verify_checkpoint

__all__ = [
    "CHECKPOINTS_SUBDIR",
    "CHECKPOINT_FILE",
    "DESCRIBE_METHOD",
    "IDLE_CONNECTION_EXPIRY_S",
    "LATEST_FILE",
    "CheckpointManifest",
    "CheckpointOutcome",
    "CheckpointTakenError",
    "CheckpointTrace",
    "ControlClient",
    "CoordinationError",
    "Coordinator",
    "GcReport",
    "HostedServer",
    "HttpClient",
    "LatestMovedError",
    "LedgerClient",
    "Member",
    "NotAParticipantError",
    "PrepareResult",
    "PublicationConflictError",
    "PublishedParticipant",
    "checkpoint",
    "checkpoint_directory",
    "checkpoint_location",
    "checkpoint_trace",
    "collect_garbage",
    "discover",
    "discover_on_ray",
    "hosted_on_ray",
    "http_transport",
    "is_pinned",
    "pin_checkpoint",
    "publish_checkpoint",
    "read_checkpoint",
    "read_latest",
    "send_while_out_of_time",
    "unpin_checkpoint",
    "verify_checkpoint",
]
