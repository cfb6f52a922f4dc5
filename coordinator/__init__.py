"""The controller side of midflight: what a training controller embeds.

- :class:`ControlClient`: the async client of one participant's control routes (a reserved
  connection pool, bounded calls, typed errors, retries of transport failures and retryable codes);
- :func:`discover` and :class:`Coordinator`: the fixed-order drivers (prepare, commit, resume,
  restore all-or-nothing, retire, forget, renew) and :class:`PrepareResult`;
- :func:`publish_checkpoint` / :func:`read_latest`: the aggregate manifest and the ``LATEST``
  pointer;
- :class:`LedgerClient`: the client of a model server's capture-ledger routes.
"""

from ._client import (
    DEFAULT_CONTROL_ATTEMPTS,
    STATUS_TIMEOUT_SECONDS,
    ControlClient,
    NotAParticipantError,
    is_retryable,
)
from ._discovery import DISCOVERY_ATTEMPTS, discover
from ._drivers import CoordinationError, Coordinator, Member, PrepareResult
from ._ledger_client import LedgerClient
from ._publish import (
    CHECKPOINT_FILE,
    CHECKPOINTS_SUBDIR,
    LATEST_FILE,
    CheckpointManifest,
    PublishedParticipant,
    checkpoint_directory,
    publish_checkpoint,
    publish_checkpoint_sync,
    read_checkpoint,
    read_latest,
)

__all__ = [
    "CHECKPOINTS_SUBDIR",
    "CHECKPOINT_FILE",
    "DEFAULT_CONTROL_ATTEMPTS",
    "DISCOVERY_ATTEMPTS",
    "LATEST_FILE",
    "STATUS_TIMEOUT_SECONDS",
    "CheckpointManifest",
    "ControlClient",
    "CoordinationError",
    "Coordinator",
    "LedgerClient",
    "Member",
    "NotAParticipantError",
    "PrepareResult",
    "PublishedParticipant",
    "checkpoint_directory",
    "discover",
    "is_retryable",
    "publish_checkpoint",
    "publish_checkpoint_sync",
    "read_checkpoint",
    "read_latest",
]
