"""/metrics of the default server (ddtree, auto budget, dflash + suffix drafts, float32): the ddtree_* series,
the per-source accepted-token counter after a copy-heavy request that accepts suffix drafts, and vLLM's names
with vLLM's meanings beside them (docs/API.md, Metrics)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import read_metrics
from tests.server.test_server import _http, client, model_name  # noqa: F401 - the server fixtures


@pytest.fixture(scope="module")
def server(shared_default_server):
    """The default server, shared with test_chat_fields.py / test_metrics.py (tests/server/conftest.py): client
    and model_name (test_server.py's fixtures) read it through this name."""
    return shared_default_server


def test_metrics_parse(server, model_name) -> None:  # noqa: F811
    assert _http(server, "POST", "/v1/completions",
                 json={"model": model_name, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(server["base"] + "/metrics", timeout=30).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in (("ddtree_requests", "counter"), ("ddtree_time_to_first_token_seconds", "histogram"),
                       ("ddtree_inter_token_latency_seconds", "histogram"),
                       ("ddtree_spec_acceptance_length", "histogram"), ("ddtree_kv_usage", "gauge"),
                       ("ddtree_num_running_reqs", "gauge"), ("ddtree_num_queue_reqs", "gauge"),
                       ("ddtree_spec_chosen_budget", "histogram"), ("ddtree_spec_observed_accepted_tokens", "counter"),
                       ("ddtree_spec_predicted_accepted_tokens", "counter")):
        assert families.get(name) == kind, name
    m = read_metrics(server["base"])
    for name in ("ddtree_requests_total", "ddtree_prompt_tokens_total", "ddtree_generation_tokens_total",
                 "ddtree_time_to_first_token_seconds_count", "ddtree_inter_token_latency_seconds_count",
                 "ddtree_kv_total_tokens"):
        assert name in m, name
    assert m["ddtree_generation_tokens_total"] > 0 and m["ddtree_kv_total_tokens"] > 0
    assert m["ddtree_spec_chosen_budget_count"] > 0  # the default: auto budget, one observation per request-step


def test_default_server_copies_with_suffix_drafts(server, client, model_name) -> None:  # noqa: F811
    """The default `serve` (ddtree, auto budget, DFlash + suffix drafts): a copy-heavy request accepts suffix
    drafts (spec_stats.accepted_by_source, and the per-source counter in /metrics)."""
    from tests.speculative.test_suffix_engine import COPY

    before = read_metrics(server["base"]).get("ddtree_spec_accepted_tokens_total", 0.0)
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": COPY[0]}],
                                       max_tokens=48, temperature=0)
    stats = r.model_extra["spec_stats"]
    assert stats["accepted_by_source"]["suffix"] > 0, stats
    # it drafted: acceptance over the steps that verified a tree (each offered at least one node)
    v = stats["verify_steps"]
    assert v > 0 and stats["mean_budget"] >= 1, stats
    assert stats["acceptance_length"] == round((stats["accepted_tokens"] + v) / v, 4), stats
    decode_tokens = r.usage.completion_tokens - 1  # the first token comes from the prefill
    assert decode_tokens - stats["plain_steps"] in (stats["accepted_tokens"] + v, stats["accepted_tokens"] + v - 1)
    assert sum(stats["accepted_by_source"].values()) == stats["accepted_tokens"]
    by_source = {src: v for (name, src), v in read_metrics(server["base"], "source").items()
                 if name == "ddtree_spec_accepted_tokens_total"}
    assert set(by_source) == {"dflash", "suffix"} and by_source["suffix"] >= stats["accepted_by_source"]["suffix"]
    assert sum(by_source.values()) - before >= stats["accepted_tokens"]


def test_vllm_metric_names(server) -> None:  # noqa: F811
    """vLLM's names beside ddtree_* (issue 46 item 9), with vLLM's meanings, after the copy request above
    accepted drafts: counters consistent with each other and with ddtree_*'s."""
    names = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:spec_decode_num_drafts": "counter",
             "vllm:spec_decode_num_draft_tokens": "counter", "vllm:spec_decode_num_accepted_tokens": "counter",
             "vllm:spec_decode_num_accepted_tokens_per_pos": "counter"}
    deadline = time.time() + 30
    while True:  # the scheduler's stats reach the front end every few steps
        text = httpx.get(server["base"] + "/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        m = read_metrics(server["base"])
        if m.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    for name, kind in names.items():
        assert families[name].type == kind, name
        assert all(s.labels.get("model_name") for s in families[name].samples), name
    drafts, offered = m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = {p: v for (n, p), v in read_metrics(server["base"], "position").items()
               if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert 0 < accepted <= offered and drafts <= offered
    assert sum(per_pos.values()) == accepted and per_pos["0"] <= drafts
    assert per_pos["0"] >= per_pos.get("1", 0) >= per_pos.get("2", 0)
    assert m["vllm:prefix_cache_queries_total"] > 0 and m["vllm:prefix_cache_queries_total"] >= m["vllm:prefix_cache_hits_total"]
    assert m["vllm:prefix_cache_hits_total"] == m["ddtree_cached_prompt_tokens_total"]
    assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
    assert m["vllm:time_to_first_token_seconds_count"] == m["ddtree_time_to_first_token_seconds_count"] > 0
