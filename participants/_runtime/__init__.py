"""The control plane every participant embeds: the phase machine, commit and restore procedures, marks, jobs, clock, telemetry."""
