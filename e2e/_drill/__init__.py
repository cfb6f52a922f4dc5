"""The crash-restore drill: the rollout controller process, its control session, the oracle, probes, the kill -9 matrix."""
