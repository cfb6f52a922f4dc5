"""Inference-worker staging: the token staging store and the helpers a worker calls per generation."""
