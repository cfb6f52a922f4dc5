"""Checkpoint storage: the records and manifest writer and reader, the durable-write helpers, the checkpoint root."""
