"""``param`` on admission refusals, over real HTTP (issue 38): a 400 about one field names it, in the API's own
terms, whether the HTTP front end refuses the request (the prompt against the context) or the engine does at
admission (the prompt against the KV cache: the scheduler's checks, ddtree_serve/server/scheduling/scheduler.py).

A real server process with the default model, a 1024-token context and a 160-token KV cache (no speculation:
a one-slot margin), so a prompt of ~190 tokens fits the context but not the cache."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import running_server

pytestmark = pytest.mark.slow  # its own server (~40-70 s to start on 2 busy cores); the fast, model-free check of
# the same mapping: tests/server/test_admission_refusals.py

LONG = "word " * 200  # ~230 prompt tokens with the chat template: over the KV cache, within the context
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--context-length", "1024", "--max-total-tokens", "160", "--speculative-algorithm", "none",
            "--max-running-requests", "2"]
    with running_server(args, tmp_path_factory.mktemp("admission")) as srv:
        yield srv.base


def _error(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    return err


# (route, body, param, words of the message): the engine's refusals (the KV cache)
ENGINE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages", "no room"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}, "messages",
     "no room"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 150}, "messages", "KV cache"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 150, "n": 2}, "messages", "KV cache"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 200}, "prompt", "KV cache"),
    ("/v1/completions", {"prompt": ["Hello", LONG], "max_tokens": 1}, "prompt", "KV cache"),
    ("/v1/responses", {"input": "Say hi.", "max_output_tokens": 150}, "input", "KV cache"),
]
# the HTTP front end's (the context): OpenAI's code context_length_exceeded
FRONT = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1100}, "messages"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1100}, "prompt"),
    ("/v1/responses", {"input": "Say hi.", "max_output_tokens": 1100}, "input"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), ENGINE)
def test_engine_refusals_name_the_field(base, path, body, param, words) -> None:
    err = _error(base, path, body)
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize(("path", "body", "param"), FRONT)
def test_context_refusals_name_the_field(base, path, body, param) -> None:
    err = _error(base, path, body)
    assert err["param"] == param and err["code"] == "context_length_exceeded", err


def test_messages_api_refusal_is_anthropic_shaped(base) -> None:
    r = httpx.post(base + "/v1/messages", json={"max_tokens": 150, "messages": USER}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "KV cache" in r.json()["error"]["message"]


def test_the_server_still_serves(base) -> None:
    r = httpx.post(base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
