"""vLLM's metric names beside ``ddtree_*``, with vLLM's meanings, so routers and dashboards that read vLLM's
metrics (llm-d's and Dynamo's routers, vLLM Grafana boards) work unchanged (docs/API.md, Metrics).

Same registry and ``model_name`` label as ``ServerMetrics`` (metrics.py), which feeds these from the same
events: request counts and KV usage from the scheduler's stats, latencies from the tokenizer manager.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ddtree_serve.server.io_struct import SchedulerStats

# vLLM's buckets for time to first token and inter-token latency (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
_COUNTED = ("prefix_queries", "prefix_hits", "drafts", "draft_tokens", "accepted")


class VllmMetrics:
    """``vllm:*`` series of one server."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        m, labels, reg = model_name, ["model_name"], registry
        self._model = m
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches", labels,
                             registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", labels, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", labels,
                              registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds",
                              labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds",
                             labels, buckets=ITL_BUCKETS, registry=reg)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries: prompt tokens of "
                                      "admitted requests", labels, registry=reg)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits: prompt tokens served from the "
                                   "cache", labels, registry=reg)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts: request-steps that verified a "
                              "draft", labels, registry=reg)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed (tree nodes)",
                                    labels, registry=reg)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                registry=reg)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position "
                               "in the draft (0: the first token after the root)", labels + ["position"],
                               registry=reg)
        self._seen: dict[str, int] = dict.fromkeys(_COUNTED, 0)
        self._pos_seen: list[int] = []
        for metric in (self.running, self.waiting, self.kv_usage, self.ttft, self.itl, self.prefix_queries,
                       self.prefix_hits, self.drafts, self.draft_tokens, self.accepted):
            metric.labels(m)
        self.per_pos.labels(m, "0")

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self._model).observe(seconds)

    def update_scheduler(self, stats: SchedulerStats) -> None:
        m = self._model
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.kv_usage.labels(m).set(stats.kv_used_tokens / stats.kv_total_tokens if stats.kv_total_tokens else 0.0)
        now = {"prefix_queries": stats.cache_query_tokens, "prefix_hits": stats.cache_hit_tokens,
               "drafts": stats.spec_drafts, "draft_tokens": stats.spec_draft_tokens,
               "accepted": stats.spec_accepted_tokens}
        for name, value in now.items():  # the scheduler's counters are cumulative: export their growth
            if value > self._seen[name]:
                getattr(self, name).labels(m).inc(value - self._seen[name])
                self._seen[name] = value
        for pos, value in enumerate(stats.spec_accepted_per_pos):
            if pos >= len(self._pos_seen):
                self._pos_seen.append(0)
            if value > self._pos_seen[pos]:
                self.per_pos.labels(m, str(pos)).inc(value - self._pos_seen[pos])
                self._pos_seen[pos] = value
