"""Chat and completion fields that change the reply (issue 46 item 5): honoured as vLLM honours them
(``min_tokens``, ``add_generation_prompt``, ``continue_final_message``, ``skip_special_tokens``) or refused with
a 400 naming the field (``store: true``, ``metadata``, ``service_tier``, ``prediction``, ``stream_options``
without ``stream``), never ignored. min_tokens also at the engine: plain == DDTree token for token."""

from __future__ import annotations

import httpx
import pytest

from tests.server.test_server import KEY, client, model_name  # noqa: F401 - the shared server fixtures


@pytest.fixture(scope="module")
def server(shared_default_server):
    """The default server, shared with test_chat_fields.py / test_metrics.py (tests/server/conftest.py): client
    and model_name (test_server.py's fixtures) read it through this name."""
    return shared_default_server


SHORT = [{"role": "user", "content": "Reply with one word: yes or no?"}]


def _post(srv: dict, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv["base"] + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_min_tokens_holds_eos_back(server, model_name) -> None:  # noqa: F811
    body = {"model": model_name, "messages": SHORT, "temperature": 0, "max_tokens": 40}
    free = _post(server, "/v1/chat/completions", body).json()
    assert free["choices"][0]["finish_reason"] == "stop" and free["usage"]["completion_tokens"] < 12
    held = _post(server, "/v1/chat/completions", {**body, "min_tokens": 24}).json()
    assert held["usage"]["completion_tokens"] >= 24
    bad = _post(server, "/v1/chat/completions", {**body, "min_tokens": 50})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_template_flags(server, model_name) -> None:  # noqa: F811
    """continue_final_message continues the assistant's text; add_generation_prompt false leaves the header
    out; both change the prompt the template renders (prompt_tokens)."""
    msgs = SHORT + [{"role": "assistant", "content": "The answer is"}]
    base = {"model": model_name, "temperature": 0, "max_tokens": 4}
    cont = _post(server, "/v1/chat/completions", {**base, "messages": msgs, "add_generation_prompt": False,
                                                   "continue_final_message": True}).json()
    fresh = _post(server, "/v1/chat/completions", {**base, "messages": SHORT}).json()
    no_header = _post(server, "/v1/chat/completions", {**base, "messages": SHORT, "add_generation_prompt": False}).json()
    assert cont["usage"]["prompt_tokens"] > fresh["usage"]["prompt_tokens"] > no_header["usage"]["prompt_tokens"]
    tok = _post(server, "/tokenize", {"model": model_name, "messages": msgs, "add_generation_prompt": False,
                                      "continue_final_message": True}).json()
    assert tok["count"] == cont["usage"]["prompt_tokens"]
    both = _post(server, "/v1/chat/completions", {**base, "messages": msgs, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]


def test_skip_special_tokens_false_keeps_them(server, model_name) -> None:  # noqa: F811
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 6, "temperature": 0, "logit_bias": {"1": 100}}
    kept = _post(server, "/v1/completions", {**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    skipped = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert "<|im_start|>" in kept and "<|im_start|>" not in skipped


@pytest.mark.parametrize(("field", "value"), [
    ("store", True), ("metadata", {"k": "v"}), ("service_tier", "flex"), ("stream_options", {"include_usage": True}),
    ("prediction", {"type": "file", "content": "x"}),
])
def test_refused_fields_name_themselves(server, model_name, field, value) -> None:  # noqa: F811
    r = _post(server, "/v1/chat/completions", {"model": model_name, "messages": SHORT, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_accepted_defaults_of_refused_fields(server, model_name) -> None:  # noqa: F811
    body = {"model": model_name, "messages": SHORT, "max_tokens": 2, "store": False, "metadata": None,
            "service_tier": "auto", "prediction": {"type": "content", "content": "yes"}}
    assert _post(server, "/v1/chat/completions", body).status_code == 200


def test_min_tokens_plain_equals_ddtree(default_model_path) -> None:
    """min_tokens bans EOS per tree node by its depth: DDTree equals plain decoding token for token, greedy
    and seeded, and no output ends before min_tokens."""
    from benchmarks.common import CHAT_PROMPTS, chat_ids
    from ddtree_serve.server.engine import Engine, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, min_tokens=30)]
    outs = {}
    for name, kw in (("plain", {}), ("ddtree", dict(speculative_algorithm="ddtree", draft_model_path="default",
                                                     ddtree_budget=16))):
        eng = Engine(default_model_path, dtype="float32", max_total_tokens=8192, **kw)
        try:
            ids = chat_ids(eng.tokenizer, CHAT_PROMPTS)[:2]
            outs[name] = eng.generate(input_ids=ids, sampling_params=params)  # one greedy, one seeded
        finally:
            eng.shutdown()
    assert [o.token_ids for o in outs["plain"]] == [o.token_ids for o in outs["ddtree"]]
    assert all(len(o.token_ids) >= 30 for o in outs["plain"])
    assert sum(o.spec_accepted_tokens for o in outs["ddtree"]) > 0


def test_prediction_is_a_draft_source_that_changes_nothing_else(default_model_path) -> None:
    """A predicted output (OpenAI's prediction) is indexed for suffix drafts: the reply is the same, and the
    drafts copy it (suffix drafts alone, no shared index of earlier outputs, so only the prediction can
    propose the answer's text)."""
    from ddtree_serve.model_executor.sampling_params import SamplingParams
    from ddtree_serve.server.engine import Engine

    eng = Engine(default_model_path, dtype="float32", max_total_tokens=8192, speculative_algorithm="ddtree",
                 draft_sources="suffix", suffix_cache_tokens=0, ddtree_budget=8)
    try:
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                                   add_generation_prompt=True, tokenize=False)
        ids = eng.tokenizer.encode(prompt, add_special_tokens=False)
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        first = eng.generate(input_ids=[ids], sampling_params=sp)[0]
        hinted = eng.generate(input_ids=[ids], sampling_params=SamplingParams(
            temperature=0, max_tokens=32, ignore_eos=True, draft_hint=tuple(first.token_ids)))[0]
    finally:
        eng.shutdown()
    assert hinted.token_ids == first.token_ids
    assert hinted.spec_accepted_tokens >= first.spec_accepted_tokens + 10, (hinted.spec_accepted_tokens,
                                                                           first.spec_accepted_tokens)
