"""The server side of midflight: the building blocks every participant embeds.

So far: durable writing and verified reading of one participant's share of a checkpoint.
"""

from ._durable import fsync_directory, make_directory_durable, write_file_durably
from ._storage import (
    WRITE_STEPS,
    ParticipantCheckpoint,
    RecordsWriter,
    read_participant_checkpoint,
)

__all__ = [
    "WRITE_STEPS",
    "ParticipantCheckpoint",
    "RecordsWriter",
    "fsync_directory",
    "make_directory_durable",
    "read_participant_checkpoint",
    "write_file_durably",
]
