"""Prometheus metrics of one server, in a registry owned by the server (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ddtree_serve.server.http.metrics_vllm import VllmMetrics
from ddtree_serve.server.io_struct import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                    5.0, 10.0, 20.0, 40.0, 80.0)
_BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# ``ddtree_requests_total{finish_reason}``: the engine's reasons, and "error" for a request that failed
# (rejected at admission, or failed by a scheduler step: docs/API.md Errors)
FINISH_REASONS = ("stop", "length", "abort", "error")
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)


class ServerMetrics:
    PREFIX = "ddtree"

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        p, labels, reg = self.PREFIX, ["model_name"], self.registry
        self._model = model_name
        self.requests = Counter(f"{p}_requests", "Finished requests, by finish reason", labels + ["finish_reason"],
                                registry=reg)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=reg)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Generated tokens", labels, registry=reg)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.accept_len = Histogram(f"{p}_spec_acceptance_length",
                                    "Tokens per target verify step of finished speculative requests", labels,
                                    buckets=_ACCEPT_BUCKETS, registry=reg)
        self.budget = Histogram(f"{p}_spec_chosen_budget", "Draft tree nodes chosen per request and verify step "
                                "(auto budget; 0 = a plain decode step)", labels, buckets=_BUDGET_BUCKETS,
                                registry=reg)
        self.accept_pred = Counter(f"{p}_spec_predicted_accepted_tokens", "Accepted draft tokens the auto budget "
                                   "controller predicted (calibrated), by sampling mode", labels + ["mode"],
                                   registry=reg)
        self.accept_obs = Counter(f"{p}_spec_observed_accepted_tokens", "Accepted draft tokens of the trees the "
                                  "auto budget controller chose, by sampling mode (sampled: the expectation over the coins "
                                  "given the tree)", labels + ["mode"], registry=reg)
        self.accepted = Counter(f"{p}_spec_accepted_tokens", "Accepted draft tokens of finished requests, by "
                                "the draft source that proposed them (dflash, suffix)", labels + ["source"],
                                registry=reg)
        self._budget_seen: dict = {}  # cumulative controller stats already exported
        self.running = Gauge(f"{p}_num_running_reqs", "Requests being decoded", labels, registry=reg)
        self.queued = Gauge(f"{p}_num_queue_reqs", "Requests waiting for admission", labels, registry=reg)
        self.kv_used = Gauge(f"{p}_kv_used_tokens", "KV cache slots in use", labels, registry=reg)
        self.kv_total = Gauge(f"{p}_kv_total_tokens", "KV cache slots in total", labels, registry=reg)
        self.kv_usage = Gauge(f"{p}_kv_usage", "Fraction of KV cache slots in use", labels, registry=reg)
        self.cached_prompt = Counter(f"{p}_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     labels, registry=reg)
        self.cache_hit_rate = Gauge(f"{p}_prefix_cache_hit_rate", "Share of admitted prompt tokens served from "
                                    "the prefix cache (since start)", labels, registry=reg)
        self.cache_held = Gauge(f"{p}_prefix_cache_tokens", "KV slots held by the prefix cache", labels,
                                registry=reg)
        self._cached_seen = 0
        self.inflight = Gauge(f"{p}_num_inflight_http_reqs", "Requests held by the HTTP front end", labels,
                              registry=reg)
        self._export_zeros()
        self.vllm = VllmMetrics(reg, model_name)  # vLLM's names beside ours (metrics_vllm.py)

    def _export_zeros(self) -> None:
        """Create every series up front, so /metrics lists each one at 0 before its first increment (a
        Prometheus rate() over a series that appears late misses its first increments)."""
        m = self._model
        for reason in FINISH_REASONS:
            self.requests.labels(m, reason)
        for counter in (self.accept_pred, self.accept_obs):
            for mode in ("greedy", "sampled"):
                counter.labels(m, mode)
        for source in ("dflash", "suffix"):
            self.accepted.labels(m, source)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.accept_len,
                       self.budget, self.running, self.queued, self.kv_used, self.kv_total, self.kv_usage,
                       self.cached_prompt, self.cache_hit_rate, self.cache_held, self.inflight):
            metric.labels(m)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)
        self.vllm.observe_first_token(seconds)

    def observe_tokens(self, n: int, seconds: float | None) -> None:
        """``n`` new tokens arrived ``seconds`` after the previous ones (None: the first tokens)."""
        if n <= 0:
            return
        self.generation_tokens.labels(self._model).inc(n)
        if seconds is not None:
            h = self.itl.labels(self._model)
            for _ in range(n):
                h.observe(seconds / n)
                self.vllm.observe_inter_token(seconds / n)

    def observe_finished(self, finish_reason: str | None, prompt_tokens: int, e2e_seconds: float,
                         verify_steps: int, accepted_tokens: int, accepted_suffix: int = 0) -> None:
        self.requests.labels(self._model, finish_reason or "error").inc()
        if verify_steps > 0:
            self.accepted.labels(self._model, "dflash").inc(accepted_tokens - accepted_suffix)
            self.accepted.labels(self._model, "suffix").inc(accepted_suffix)
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.e2e.labels(self._model).observe(e2e_seconds)
        if verify_steps > 0:
            self.accept_len.labels(self._model).observe((accepted_tokens + verify_steps) / verify_steps)

    def set_inflight(self, n: int) -> None:
        self.inflight.labels(self._model).set(n)

    def update_scheduler(self, stats: SchedulerStats) -> None:
        m = self._model
        self.vllm.update_scheduler(stats)
        self.running.labels(m).set(stats.running)
        self.queued.labels(m).set(stats.waiting)
        self.kv_used.labels(m).set(stats.kv_used_tokens)
        self.kv_total.labels(m).set(stats.kv_total_tokens)
        self.kv_usage.labels(m).set(stats.kv_used_tokens / stats.kv_total_tokens if stats.kv_total_tokens else 0.0)
        if stats.cache_hit_tokens > self._cached_seen:
            self.cached_prompt.labels(m).inc(stats.cache_hit_tokens - self._cached_seen)
            self._cached_seen = stats.cache_hit_tokens
        q = stats.cache_query_tokens
        self.cache_hit_rate.labels(m).set(stats.cache_hit_tokens / q if q else 0.0)
        self.cache_held.labels(m).set(stats.cache_held_tokens)
        if stats.spec_budget:
            self._update_budget(stats.spec_budget)

    def _update_budget(self, spec: dict) -> None:
        """Export the growth of the controller's cumulative counters since the last update."""
        m, seen = self._model, self._budget_seen
        hist = self.budget.labels(m)
        for budget, count in spec.get("budget_counts", {}).items():
            for _ in range(count - seen.get(("b", budget), 0)):
                hist.observe(budget)
            seen[("b", budget)] = count
        for key, counter in (("predicted_accepted", self.accept_pred), ("observed_accepted", self.accept_obs)):
            for mode, value in zip(("greedy", "sampled"), spec.get(key, ()), strict=False):
                delta = value - seen.get((key, mode), 0.0)
                if delta > 0:
                    counter.labels(m, mode).inc(delta)
                seen[(key, mode)] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
