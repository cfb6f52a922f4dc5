"""Servers with several worker processes: the fan-out participant, its members and their channel."""
