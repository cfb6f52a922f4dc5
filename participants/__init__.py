"""The server side of midflight: the building blocks every participant embeds.

So far: durable writing and verified reading of one participant's share of a checkpoint, and
the capture ledger (file-backed and in-memory) with its control routes.
"""

from ._durable import fsync_directory, make_directory_durable, write_file_durably
from ._ledger_cache import (
    DEFAULT_MAX_CACHED_ROLLOUTS,
    DEFAULT_MAX_CACHED_ROWS,
    LedgerCacheCollector,
    RowCache,
)
from ._ledger_common import CAPTURE_FILE_SUFFIXES
from ._ledger_file import RETIRE_STEPS, FileCaptureLedger
from ._ledger_locks import DEFAULT_STRIPES, LOCK_DIRECTORY
from ._ledger_memory import MemoryCaptureLedger
from ._ledger_routes import ledger_control_router
from ._storage import (
    WRITE_STEPS,
    ParticipantCheckpoint,
    RecordsWriter,
    read_participant_checkpoint,
)

__all__ = [
    "CAPTURE_FILE_SUFFIXES",
    "DEFAULT_MAX_CACHED_ROLLOUTS",
    "DEFAULT_MAX_CACHED_ROWS",
    "DEFAULT_STRIPES",
    "LOCK_DIRECTORY",
    "RETIRE_STEPS",
    "WRITE_STEPS",
    "FileCaptureLedger",
    "LedgerCacheCollector",
    "MemoryCaptureLedger",
    "ParticipantCheckpoint",
    "RecordsWriter",
    "RowCache",
    "fsync_directory",
    "ledger_control_router",
    "make_directory_durable",
    "read_participant_checkpoint",
    "write_file_durably",
]
