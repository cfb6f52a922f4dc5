"""The checkpoint store: the one part of ``protocols`` that touches storage (D327)."""

from .durable import fsync_directory, make_directory_durable, write_file_durably
from .interface import (
    S3_SCHEME,
    CheckpointStore,
    ObjectMissingError,
    StoredObject,
    StoreError,
    is_object_store_url,
    key_under,
    split_s3_url,
    store_key,
)
from .opening import open_store

__all__ = [
    "S3_SCHEME",
    "CheckpointStore",
    "ObjectMissingError",
    "StoreError",
    "StoredObject",
    "fsync_directory",
    "is_object_store_url",
    "key_under",
    "make_directory_durable",
    "open_store",
    "split_s3_url",
    "store_key",
    "write_file_durably",
]
