"""The agent participant: sessions parked at their last boundary, and the restart-only agent."""
