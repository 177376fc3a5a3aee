"""Sampling fields over real HTTP (issue 14, item 4), on a real server process with the default model on CPU.
Penalties and logit_bias take effect, and bad values get a 400 in OpenAI's error JSON. A response_format
without its schema, and a forced tool_choice on a server started without --tool-call-parser, are a 400
too, never silently dropped (structured output itself: tests/server/test_structured_http.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import running_server

USER = [{"role": "user", "content": "Count from one to ten."}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(["--max-total-tokens", "8192", "--max-prompt-tokens", "300"],
                        tmp_path_factory.mktemp("server")) as srv:
        yield srv.base


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _chat(base: str, **kw) -> httpx.Response:
    return _post(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 12, "temperature": 0, **kw})


BAD = [
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 3.0}, "repetition_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"42": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),  # SmolLM2's vocabulary has 49152 ids
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
    # known fields the server cannot honour: a 400 naming them, never silently dropped (issue 38)
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": " and so on."}, "suffix"),
    ("/v1/chat/completions", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3, "logprobs": False}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # auto
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
     "tools"),
    # a prompt too long: the field it came from (chat: messages; completions: prompt)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ("/v1/chat/completions", {"max_tokens": 9000}, "messages"),  # prompt + max_tokens beyond the context
    ("/v1/completions", {"prompt": "word " * 400}, "prompt"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 9}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": -100.5}}, "logit_bias"),
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD)
def test_bad_sampling_fields_are_400(base, path, extra, param) -> None:
    body = {"messages": USER} if path.endswith("chat/completions") else {}
    r = _post(base, path, {**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text


def test_accepted_forms_of_the_refused_fields(base) -> None:
    """What these fields mean without effect is accepted: no constraint, tools not used, best_of equal to n, an
    empty suffix, top_logprobs with logprobs."""
    assert _chat(base, response_format={"type": "text"}).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _chat(base, tools=tools, tool_choice="none").status_code == 200
    r = _chat(base, logprobs=True, top_logprobs=2)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    r = _post(base, "/v1/completions", {"prompt": "The sky is", "max_tokens": 2, "n": 2, "best_of": 2, "suffix": ""})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_penalties_and_logit_bias_take_effect(base) -> None:
    plain = _chat(base).json()["choices"][0]["message"]["content"]
    penalised = _chat(base, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    assert penalised.status_code == 200
    assert penalised.json()["choices"][0]["message"]["content"] != plain
    forced = _post(base, "/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 1.0,
                                              "logit_bias": {"28": 100}})  # id 28: ',' in SmolLM2's vocabulary
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == ",,,", forced.json()


# ---- issue 38: spec_stats, echo, metrics at 0, the OpenAPI spec ------------------------------------------
def test_spec_stats_count_plain_steps_apart(base) -> None:
    """The default server (ddtree, auto budget). A request of max_tokens 2 has one decode step, with one token
    left, where no draft node can be of use: it never drafts, so it has one plain step, no verify step and
    acceptance 0 (it used to report verify_steps 1, acceptance_length 1.0). Longer requests: the steps add up
    to the tokens, and acceptance is over the verify steps only (each offered at least one node)."""
    before = _hist_count(base, "ddtree_spec_acceptance_length")
    r = _chat(base, max_tokens=2, ignore_eos=True)
    assert r.status_code == 200, r.text
    stats = r.json()["spec_stats"]
    assert stats == {"verify_steps": 0, "plain_steps": 1, "accepted_tokens": 0, "acceptance_length": 0.0,
                     "mean_budget": 0.0, "accepted_by_source": {"dflash": 0, "suffix": 0}}, stats
    assert _hist_count(base, "ddtree_spec_acceptance_length") == before  # no verify step: not observed
    for body in ({"max_tokens": 24}, {"max_tokens": 24, "temperature": 1.0, "seed": 1}):
        r = _chat(base, ignore_eos=True, **body)
        stats, tokens = r.json()["spec_stats"], r.json()["usage"]["completion_tokens"]
        v, a = stats["verify_steps"], stats["accepted_tokens"]
        assert tokens == 24 and (tokens - 1) - stats["plain_steps"] in (a + v, a + v - 1), stats
        assert stats["acceptance_length"] == (round((a + v) / v, 4) if v else 0.0), stats
        assert (stats["mean_budget"] >= 1) if v else (stats["mean_budget"] == 0), stats


def _hist_count(base: str, name: str) -> float:
    from tests.server.conftest import read_metrics

    return read_metrics(base).get(f"{name}_count", 0.0)


def test_echo_without_generation_has_spec_stats(base) -> None:
    body = {"prompt": "The sky is", "echo": True, "max_tokens": 0}
    r = _post(base, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["spec_stats"]["verify_steps"] == 0 and r.json()["spec_stats"]["plain_steps"] == 0
    events = []
    with httpx.stream("POST", base + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    import json

    chunks = [json.loads(ln[6:]) for ln in events[:-1]]
    assert events[-1] == "data: [DONE]" and chunks[-1]["usage"]["prompt_tokens"] > 0
    assert all(isinstance(c.get("spec_stats"), dict) for c in chunks), chunks


def test_metrics_series_exist_at_zero(base) -> None:
    from tests.server.conftest import read_metrics

    by_reason = {k[1]: v for k, v in read_metrics(base, "finish_reason").items() if k[0] == "ddtree_requests_total"}
    assert set(by_reason) == {"stop", "length", "abort", "error"} and by_reason["abort"] == 0, by_reason
    by_mode = read_metrics(base, "mode")
    for name in ("ddtree_spec_predicted_accepted_tokens_total", "ddtree_spec_observed_accepted_tokens_total"):
        assert (name, "greedy") in by_mode and (name, "sampled") in by_mode, name
    by_source = read_metrics(base, "source")
    assert ("ddtree_spec_accepted_tokens_total", "dflash") in by_source
    assert ("ddtree_spec_accepted_tokens_total", "suffix") in by_source


def test_openapi_publishes_the_validation_constraints(base) -> None:
    spec = httpx.get(base + "/openapi.json", timeout=30).json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses, responses
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    chat, completion = schemas["ChatCompletionRequest"], schemas["CompletionRequest"]
    top_k, n = chat["properties"]["top_k"]["anyOf"][0], chat["properties"]["n"]["anyOf"][0]  # null: the default
    assert {"type": "null"} in chat["properties"]["top_k"]["anyOf"]
    assert top_k["minimum"] == -1 and top_k["not"] == {"const": 0}
    assert n["maximum"] == 64 and chat["required"] == ["messages"]
    bias = chat["properties"]["logit_bias"]["anyOf"][0]
    assert bias["additionalProperties"] is False and bias["patternProperties"]["^[0-9]+$"]["maximum"] == 100
    assert chat["allOf"][0]["then"]["properties"]["logprobs"] == {"const": True}  # top_logprobs needs logprobs
    assert any(r["if"]["properties"]["role"]["enum"] == ["tool"] for r in schemas["ChatMessage"]["allOf"])
    assert completion["properties"]["suffix"]["anyOf"][0]["maxLength"] == 0
    assert completion["allOf"][0]["then"]["properties"]["max_tokens"] == {"minimum": 1}  # 0 only with echo
