"""``/metrics``: the server's Prometheus metrics, one registry per server (prometheus_client writes the text).

Gauges: ``kvq_sequences_running`` and ``kvq_sequences_waiting``, ``kvq_cache_rows_used`` / ``kvq_cache_rows_free``
/ ``kvq_cache_rows_cached`` (idle, keeping a prefix for reuse), ``kvq_cache_bytes`` (allocated),
``kvq_cache_bytes_used`` / ``kvq_cache_bytes_free`` (of the budget), ``kvq_cache_tokens`` (held by running
sequences) and ``kvq_batch_invariant`` (1 when the start-up self-check found every row's logits in a batch equal to
the same sequence alone). Counters: ``kvq_preemptions_total``, ``kvq_prompt_tokens_total``,
``kvq_prefix_cache_queries_total`` / ``kvq_prefix_cache_hits_total`` (prompt tokens looked up in the prefix cache /
reused from it, as vLLM counts them), ``kvq_generation_tokens_total``, ``kvq_requests_total{finish}``. Histograms:
``kvq_time_to_first_token_seconds``, ``kvq_request_latency_seconds`` (arrival to the last token). The process
collector adds ``process_resident_memory_bytes``.
"""

from __future__ import annotations

#: histogram buckets, seconds (time to first token and request latency both)
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServeMetrics:
    """The metrics one server updates (thread-safe: the backend's thread and the event loop both write)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=self.registry)

        self.sequences_running = gauge("kvq_sequences_running", "Sequences generating (holding a cache row).")
        self.sequences_waiting = gauge("kvq_sequences_waiting", "Requests waiting for a cache row.")
        self.cache_rows_used = gauge("kvq_cache_rows_used", "Cache rows holding a sequence.")
        self.cache_rows_free = gauge("kvq_cache_rows_free", "Cache rows free for the next request.")
        self.cache_bytes = gauge("kvq_cache_bytes", "Bytes of the cache segments allocated now.")
        self.cache_bytes_used = gauge("kvq_cache_bytes_used", "Bytes of the rows running or cached sequences hold.")
        self.cache_bytes_free = gauge("kvq_cache_bytes_free", "Bytes of the cache budget no row holds.")
        self.cache_tokens = gauge("kvq_cache_tokens", "Tokens the rows of running sequences hold.")
        self.preemptions = Counter("kvq_preemptions", "Sequences preempted for want of cache memory (recomputed).",
                                   registry=self.registry)
        self.batch_invariant = gauge("kvq_batch_invariant",
                                     "1 when a row's logits in a batch equal its logits alone (start-up check).")
        self.prompt_tokens = Counter("kvq_prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=self.registry)
        self.prefix_queries = Counter("kvq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=self.registry)
        self.prefix_hits = Counter("kvq_prefix_cache_hits", "Prompt tokens reused from the prefix cache.",
                                   registry=self.registry)
        self.cache_rows_cached = gauge("kvq_cache_rows_cached", "Idle cache rows keeping a prefix for reuse.")
        self.generation_tokens = Counter("kvq_generation_tokens", "Tokens generated.", registry=self.registry)
        self.requests = Counter("kvq_requests", "Requests ended, by how they ended.", ["finish"],
                                registry=self.registry)
        self.time_to_first_token = Histogram("kvq_time_to_first_token_seconds", "Arrival to the first token.",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram("kvq_request_latency_seconds", "Arrival to the end of the request.",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
