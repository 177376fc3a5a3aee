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
    from model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(["--max-total-tokens", "8192"], tmp_path_factory.mktemp("server")) as srv:
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
    ("/v1/chat/completions", {"logit_bias": {"49152": 1}}, None),  # SmolLM2's vocabulary has 49152 ids
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


def test_text_response_format_and_auto_tool_choice_are_accepted(base) -> None:  # unconstrained
    assert _chat(base, response_format={"type": "text"}).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _chat(base, tools=tools, tool_choice="auto").status_code == 200


def test_penalties_and_logit_bias_take_effect(base) -> None:
    plain = _chat(base).json()["choices"][0]["message"]["content"]
    penalised = _chat(base, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    assert penalised.status_code == 200
    assert penalised.json()["choices"][0]["message"]["content"] != plain
    forced = _post(base, "/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 1.0,
                                              "logit_bias": {"28": 100}})  # id 28: ',' in SmolLM2's vocabulary
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == ",,,", forced.json()
