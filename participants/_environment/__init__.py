"""The environment participant: episodes parked at step boundaries."""
