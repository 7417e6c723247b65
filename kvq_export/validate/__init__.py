"""Validation against the fp16 baseline: token behaviour, attention behaviour, memory and latency.

At long range (perplexity by distance, retrieval): :mod:`.long_context`.
"""
