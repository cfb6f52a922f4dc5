"""The deterministic inference worker: generations, staging, generation cuts."""
