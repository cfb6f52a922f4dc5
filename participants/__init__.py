"""The server side of midflight: the building blocks every participant embeds.

So far: durable writing and verified reading of one participant's share of a checkpoint, the
inference worker's staging helpers and a file-backed token staging store.
"""

from ._durable import fsync_directory, make_directory_durable, write_file_durably
from ._staging_store import FileTokenStagingStore
from ._storage import (
    WRITE_STEPS,
    ParticipantCheckpoint,
    RecordsWriter,
    read_participant_checkpoint,
)
from ._worker_calls import (
    ActiveCall,
    CaptureAdapter,
    CaptureError,
    RolloutTokenCapture,
    StreamingUnsupportedError,
    rebuild_generation_cut,
)

__all__ = [
    "WRITE_STEPS",
    "ActiveCall",
    "CaptureAdapter",
    "CaptureError",
    "FileTokenStagingStore",
    "ParticipantCheckpoint",
    "RecordsWriter",
    "RolloutTokenCapture",
    "StreamingUnsupportedError",
    "fsync_directory",
    "make_directory_durable",
    "read_participant_checkpoint",
    "rebuild_generation_cut",
    "write_file_durably",
]
