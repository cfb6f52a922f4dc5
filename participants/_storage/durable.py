"""The durability primitives, from the checkpoint store's POSIX side (``protocols``)."""

from protocols import fsync_directory, make_directory_durable, write_file_durably

__all__ = ["fsync_directory", "make_directory_durable", "write_file_durably"]
