"""Validation against the fp16 baseline: token behaviour, attention behaviour, memory and latency."""
