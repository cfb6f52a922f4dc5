"""The resources participant: session state exported, stateless or restart-only."""
