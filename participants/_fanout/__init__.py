"""Servers with several processes: the fan-out in the main process, its shards and their channel."""
