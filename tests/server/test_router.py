"""Data-parallel scale-out: two real replicas behind sglang-router's cache-aware policy (docs/PARALLEL.md).

Starts two ``ddtree-serve`` replicas (default model, small limits) and ``python -m sglang_router.launch_router
--policy cache_aware`` in front of them, then drives two multi-turn conversations through the router, chat
and streaming chat. The router must have read each replica's model from our SGLang-compatible
``/server_info`` and ``/model_info``; each conversation must keep landing on the replica that served its
earlier turns (the one holding its prefix), and the two conversations on different replicas. Which replica
served a request is read from the replicas' own request counters (``/metrics``).

sglang-router 0.3.2 puts only the first registered worker into its prefix tree until a request is routed by
load, so every new prefix would go to that one worker; the two first turns are therefore sent concurrently
with ``--balance-abs-threshold 0`` (the second is routed by load to the idle replica), and the later turns
one at a time, when loads are equal and the prefix decides.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import REPO, free_port, start_server, wait_healthy

pytestmark = pytest.mark.slow

REPLICA_ARGS = ["--max-total-tokens", "4096", "--max-running-requests", "4"]
SYSTEMS = {  # long, distinct system prompts: the prefix the router matches on
    "a": "You are Ada, a patient mathematics tutor. " + "Explain every step, check each result twice, " * 8,
    "b": "You are Bert, a terse travel agent. " + "Answer with destinations, prices and dates only, " * 8,
}


def router_command(port: int, metrics_port: int, workers: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", "cache_aware", "--balance-abs-threshold", "0",
            "--prometheus-port", str(metrics_port)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    logs = tmp_path_factory.mktemp("router")
    procs, replicas = [], []
    try:
        for i in range(2):
            port = free_port()
            procs.append(start_server(["--port", str(port), *REPLICA_ARGS], logs / f"replica{i}.log"))
            replicas.append(f"http://127.0.0.1:{port}")
        for i, (proc, base) in enumerate(zip(procs, replicas, strict=True)):
            wait_healthy(proc, base, 600, logs / f"replica{i}.log")
        port = free_port()
        log = open(logs / "router.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(router_command(port, free_port(), replicas), cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        _wait_workers(procs[-1], router, 2, logs / "router.log")
        yield {"router": router, "replicas": replicas, "logs": logs}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _wait_workers(proc: subprocess.Popen, router: str, n: int, log) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            workers = httpx.get(router + "/workers", timeout=5).json()["workers"]
            if len(workers) == n and all(w["is_healthy"] and w["metadata"].get("model_type") for w in workers):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router has no {n} healthy workers:\n{log.read_text()[-3000:]}")


def _counters(replicas: list[str]) -> list[dict[str, float]]:
    out = []
    for base in replicas:
        got = {"requests": 0.0, "prompt_tokens": 0.0}
        for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
            for s in fam.samples:
                if s.name == "ddtree_requests_total":
                    got["requests"] += s.value
                elif s.name == "ddtree_prompt_tokens_total":
                    got["prompt_tokens"] += s.value
        out.append(got)
    return out


def _turn(router: str, messages: list[dict], stream: bool, started: threading.Event | None = None) -> dict:
    """One chat turn through the router: the reply text and usage (streamed or not)."""
    body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(router + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["finish_reason"] in ("stop", "length")
        return {"text": data["choices"][0]["message"]["content"], "usage": data["usage"]}
    body["stream_options"] = {"include_usage": True}
    text, usage, finish = [], None, None
    with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if started is not None:
                started.set()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            for c in data["choices"]:
                text.append(c["delta"].get("content") or "")
                finish = c.get("finish_reason") or finish
            usage = data.get("usage") or usage
    assert lines[-1] == "data: [DONE]" and finish in ("stop", "length") and usage is not None
    return {"text": "".join(text), "usage": usage}


def _check_cached(usage: dict) -> None:
    # the prefix cache (issue 16) reports reused prompt tokens; a repeated conversation must hit it
    details = usage.get("prompt_tokens_details")
    if details is not None:
        assert details["cached_tokens"] > 0, usage


def test_router_keeps_each_conversation_on_its_replica(cluster) -> None:
    router, replicas = cluster["router"], cluster["replicas"]
    workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
    for w in workers:  # read from our /server_info and /model_info (no 404 fallback)
        assert w["model_id"] == "default" and w["metadata"]["model_type"] == "llama"
        assert w["metadata"]["architectures"] == '["LlamaForCausalLM"]' and w["metadata"]["tp_size"] == "1"
    assert "falling back" not in (cluster["logs"] / "router.log").read_text()

    history = {c: [{"role": "system", "content": SYSTEMS[c]}, {"role": "user", "content": f"Hello, question 1 for {c}."}]
               for c in SYSTEMS}
    # first turns concurrently: b arrives while a is in flight, so the router sends it to the idle replica
    first: dict[str, dict] = {}
    a_started = threading.Event()
    t = threading.Thread(target=lambda: first.__setitem__("a", _turn(router, history["a"], True, a_started)))
    t.start()
    assert a_started.wait(600)
    first["b"] = _turn(router, history["b"], False)
    t.join(600)
    after = _counters(replicas)
    assert [c["requests"] for c in after] == [1, 1], after
    home = {c: next(i for i, k in enumerate(after) if k["prompt_tokens"] == first[c]["usage"]["prompt_tokens"])
            for c in SYSTEMS}
    assert home["a"] != home["b"]
    for c in SYSTEMS:
        history[c].append({"role": "assistant", "content": first[c]["text"]})

    for n, (c, stream) in enumerate([("a", True), ("a", False), ("b", False), ("a", True), ("b", True)], start=2):
        history[c].append({"role": "user", "content": f"Question {n}: and then?"})
        before = _counters(replicas)
        out = _turn(router, history[c], stream)
        after = _counters(replicas)
        served = [i for i in range(2) if after[i]["requests"] > before[i]["requests"]]
        assert served == [home[c]], (c, n, served, home)
        assert after[home[c]]["prompt_tokens"] - before[home[c]]["prompt_tokens"] == out["usage"]["prompt_tokens"]
        _check_cached(out["usage"])
        history[c].append({"role": "assistant", "content": out["text"]})
