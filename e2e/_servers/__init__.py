"""The reference servers: environment, agent, policy model, resources, and what they share (cluster file, serve context, evidence logs, peer pools)."""
