"""A real server process (default model, CPU) driven with the official ``openai`` client.

One server for the module; it is killed at the end to check that a dead child makes the server answer 503
and exit non-zero with no process left behind. A second, short-lived server checks SIGTERM during load.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.server.conftest import alive, descendants, read_metrics, running_server

KEY = "sk-test-key"
MAX_TOTAL_TOKENS = 16384
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@contextmanager
def serve_default(tmp_path_factory) -> Iterator[dict]:
    """The default server (ddtree, auto budget, DFlash + suffix drafts) with an API key, float32."""
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    # float32: greedy in a mixed batch equals greedy alone to the last bit (bfloat16 near ties, docs/DESIGN.md 1)
    args = ["--api-key", KEY, "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("server")) as srv:
        yield {"proc": srv.proc, "base": srv.base, "log": srv.log, "children": descendants(srv.proc.pid)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """This module's own server: test_dead_child_gives_503_then_exit kills it (other modules share
    tests/server/conftest.py's ``shared_default_server``, started the same way)."""
    with serve_default(tmp_path_factory) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _http(server, method: str, path: str, **kw) -> httpx.Response:
    headers = kw.pop("headers", {"Authorization": f"Bearer {KEY}"})
    return httpx.request(method, server["base"] + path, headers=headers, timeout=120, **kw)


def test_health_models_auth(server, client, model_name) -> None:
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}
    assert model_name == "default"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = _http(server, "GET", "/v1/models", headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    bad = openai.OpenAI(base_url=server["base"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="x", max_tokens=1)


def test_chat_sync_stream_and_not(client, model_name) -> None:
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["spec_stats"]
    assert stats.keys() == {"verify_steps", "plain_steps", "accepted_tokens", "acceptance_length", "mean_budget",
                            "accepted_by_source"}
    assert sum(stats["accepted_by_source"].values()) == stats["accepted_tokens"]
    text, usage, finish = "", None, None
    for ch in client.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        else:
            usage = ch.usage
    assert text == c.message.content and finish == c.finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_async(server, model_name) -> None:
    async def run():
        ac = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = await ac.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=6, temperature=0, logprobs=2)
        assert [c.index for c in r.choices] == [0, 1]
        for c in r.choices:
            assert c.finish_reason == "length" and len(c.logprobs.tokens) == 6
            assert "".join(c.logprobs.tokens) == c.text
            assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
        assert r.usage.completion_tokens == 12
        ids = (await ac.completions.create(model=model_name, prompt=[504, 3458, 282], max_tokens=3,
                                           temperature=0)).choices[0]
        assert ids.finish_reason == "length"
        text = ""
        async for ch in await ac.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6,
                                                    temperature=0, stream=True):
            text += ch.choices[0].text if ch.choices else ""
        assert text == r.choices[0].text
        await ac.close()

    asyncio.run(run())


def test_greedy_matches_offline_engine(client, model_name) -> None:
    from ddtree_serve.model_executor.sampling_params import SamplingParams
    from ddtree_serve.server.engine import Engine

    served = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=8, temperature=0).choices
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0)
    engine = Engine("default", max_total_tokens=2048)
    try:
        tok = engine.tokenizer
        chat_text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = [tok.encode(p) for p in PROMPTS] + [tok.encode(chat_text, add_special_tokens=False)]
        outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(temperature=0, max_tokens=8))
    finally:
        engine.shutdown()
    for s, o in zip(served, outs[:-1], strict=True):
        assert s.text == o.text
    assert chat.choices[0].message.content == outs[-1].text


def test_seeded_sampling_and_mixed_batch(server, client, model_name) -> None:
    def sample(seed):
        return client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=6, temperature=1.0,
                                         seed=seed).choices[0].text

    # The default server (auto budget, dflash + suffix, prefix cache), float32: a seed fixes the tokens, whatever
    # trees the budget chose and whatever the suffix index and the cache learned from the first request
    # (position-keyed draws, docs/API.md "seed").
    first = sample(123)
    assert first.strip() and sample(123) == first
    assert sample(124).strip()
    greedy = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=6,
                                       temperature=0).choices[0].text

    async def mixed():
        ac = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        temps = [0.0, 1.5, 0.0, 1.5, 0.0, 1.5]
        rs = await asyncio.gather(*[ac.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=6,
                                                          temperature=t, seed=i) for i, t in enumerate(temps)])
        await ac.close()
        return temps, [r.choices[0].text for r in rs]

    temps, texts = asyncio.run(mixed())
    assert all(t == greedy for t, temp in zip(texts, temps, strict=True) if temp == 0.0)
    assert any(t != greedy for t, temp in zip(texts, temps, strict=True) if temp > 0)


def test_64_concurrent_streams(server, model_name) -> None:
    async def one(ac, i):
        text, usage, finish = "", None, None
        stream = await ac.completions.create(model=model_name, prompt=f"{i} + {i} =", max_tokens=4,
                                             temperature=0.7, seed=i, stream=True,
                                             stream_options={"include_usage": True})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage
        return text, usage, finish

    async def run():
        ac = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=300)
        res = await asyncio.gather(*[one(ac, i) for i in range(64)])
        await ac.close()
        return res

    t0 = time.time()
    results = asyncio.run(run())
    elapsed = time.time() - t0
    for _text, usage, finish in results:
        assert finish in ("stop", "length")
        assert 1 <= usage.completion_tokens <= 4
        if finish == "length":
            assert usage.completion_tokens == 4
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    print(f"64 streams x 4 tokens: {elapsed:.1f}s")


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.01}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "tool"}]}, 400),  # a tool message needs content + tool_call_id
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, 400),  # content or tool_calls
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                           {"role": "tool", "content": "1", "tool_call_id": "c"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [  # a model without a vision tower
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8192}, 400),
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"max_tokens": 3}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "max_tokens": -5}, 400),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_inputs(server, model_name, path, body, status) -> None:
    if isinstance(body, dict):
        body = json.dumps({"model": model_name, **body}).encode()
    r = _http(server, "POST", path, content=body, headers={"Authorization": f"Bearer {KEY}",
                                                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert "Traceback" not in r.text
    ok = _http(server, "POST", "/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_stop_n_logprobs(client, model_name) -> None:
    r = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and " 7" not in c.text and c.text.startswith(" 5")
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], n=3,
                                       max_tokens=4, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    for ch in r.choices:
        assert ch.logprobs.content and all(len(t.top_logprobs) <= 2 for t in ch.logprobs.content)
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)


def test_disconnect_frees_kv(server, model_name) -> None:
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data:"):
                got += 1
            if got >= 3:
                break
        time.sleep(0.5)
        m = read_metrics(server["base"])
        assert m["ddtree_num_running_reqs"] >= 1 and m["ddtree_kv_used_tokens"] > 0
    deadline = time.time() + 30
    while time.time() < deadline:
        m = read_metrics(server["base"])
        if m["ddtree_kv_used_tokens"] == 0 and m["ddtree_num_running_reqs"] == 0:
            break
        time.sleep(0.3)
    assert m["ddtree_kv_used_tokens"] == 0 and m["ddtree_num_running_reqs"] == 0  # no lock left on the cache
    assert m["ddtree_requests_total"] >= 1


def test_prefix_cache_reports_cached_tokens(server, client, model_name) -> None:
    """A repeated conversation reuses its prefix: everything but the last prompt token is cached, in chat and
    completions, streamed or not; the metrics count the hits."""
    msgs = [{"role": "system", "content": "You answer in one word. Cached prefix test " * 6},
            {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model_name, messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    prompt = "Prefix caching keeps the KV of earlier requests. " * 4
    client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=model_name, prompt=[prompt, prompt], n=2, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 2  # counted once per prompt
    deadline = time.time() + 30
    while time.time() < deadline:
        m = read_metrics(server["base"])
        if m.get("ddtree_cached_prompt_tokens_total", 0) > 0:
            break
        time.sleep(0.3)
    assert m["ddtree_cached_prompt_tokens_total"] > 0 and 0 < m["ddtree_prefix_cache_hit_rate"] <= 1
    assert m["ddtree_prefix_cache_tokens"] > 0


def test_bench_multiturn_against_the_server(server, tmp_path) -> None:
    """benchmarks/bench_multiturn.py's logic on a short run: histories grow turn by turn, every turn is timed."""
    from benchmarks.bench_multiturn import main as bench_multiturn

    out = tmp_path / "multiturn.json"
    bench_multiturn(["--base-url", server["base"], "--api-key", KEY, "--conversations", "2", "--turns", "2",
                     "--system-words", "20", "--max-tokens", "2", "--output", str(out)])
    (res,) = json.loads(out.read_text())["results"]
    assert res["completed"] == res["turns"] == 4 and not res["errors"]
    turns = {(t["conversation"], t["turn"]): t for t in res["per_turn"]}
    for c in range(2):
        first, second = turns[c, 0], turns[c, 1]
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]  # the history grew
        assert 0 < first["ttft"] <= first["e2e"] and 0 < second["ttft"] <= second["e2e"]
        assert first["completion_tokens"] == second["completion_tokens"] == 2  # EOS ignored
    assert res["prompt_tokens"] == sum(t["prompt_tokens"] for t in res["per_turn"]) and res["output_throughput"] > 0


def test_server_info(server) -> None:
    info = httpx.get(server["base"] + "/get_server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "ddtree" and info["speculative_ddtree_budget"] == "auto"
    assert info["speculative_accept_threshold_single"] == info["speculative_accept_threshold_acc"] == 1.0
    assert info["speculative_lossy"] is False and info["api_key"] == "(set)"
    # SGLang's names (what sglang-router probes first), open without the API key like /health
    assert httpx.get(server["base"] + "/server_info", timeout=30).json() == info
    version = info["version"]
    assert version == importlib.metadata.version("ddtree-serve") and info["tp_size"] == 1
    assert httpx.get(server["base"] + "/version", timeout=30).json() == {"version": version}
    model = httpx.get(server["base"] + "/model_info", timeout=30).json()
    assert model == httpx.get(server["base"] + "/get_model_info", timeout=30).json()
    assert model["model_path"] == info["model_path"] == model["tokenizer_path"]
    assert os.path.isfile(os.path.join(model["model_path"], "config.json"))  # the resolved directory
    assert model["is_generation"] is True and model["served_model_name"] == "default"
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]  # SmolLM2


def test_dead_child_gives_503_then_exit(server) -> None:
    proc = server["proc"]
    kids = descendants(proc.pid)
    victim = max(kids, key=lambda p: int(open(f"/proc/{p}/statm").read().split()[1]))  # the scheduler (largest)
    os.kill(victim, signal.SIGKILL)
    statuses = set()
    deadline = time.time() + 15
    while time.time() < deadline and proc.poll() is None:
        try:
            statuses.add(httpx.get(server["base"] + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert proc.wait(30) == 1
    assert statuses <= {200, 503} and 503 in statuses
    time.sleep(0.5)
    assert not [p for p in kids if alive(p)]
