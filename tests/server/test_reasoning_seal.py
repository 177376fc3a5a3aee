"""Responses' ``include: ["reasoning.encrypted_content"]`` (issue 61; ddtree_serve/server/http/reasoning_seal.py):
the reasoning is sealed with authenticated encryption under the server's key and opened when the item comes
back (its text becomes that turn's reasoning); an altered token, or one sealed under another key, is a 400
naming ``input``. On a real server (default model with the deepseek-r1 reasoning parser, whose output without
a ``</think>`` is all reasoning): streamed and not, the item carries the token, and it round-trips."""

from __future__ import annotations

import json

import httpx
import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.info_routes import public_info
from ddtree_serve.server.http.protocol_responses import ResponsesRequest
from ddtree_serve.server.http.reasoning_seal import ENV_KEY, ReasoningSeal, SealError
from ddtree_serve.server.http.serving_common import parse_body
from ddtree_serve.server.http.serving_responses import to_chat
from tests.server.conftest import running_server

KEY = "a-long-random-seal-key-for-tests"


def _tamper(token: str) -> str:
    i = len(token) // 2
    return token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1:]


def test_seal_opens_only_its_own_tokens(monkeypatch) -> None:
    seal = ReasoningSeal(KEY)
    token = seal.seal("I think, therefore.")
    assert token != seal.seal("I think, therefore.")  # a fresh nonce each time
    assert seal.open(token) == "I think, therefore." and ReasoningSeal(KEY).open(token) == "I think, therefore."
    for bad in (_tamper(token), token[:-4], "not base64 !", "", ReasoningSeal("other").seal("x")):
        with pytest.raises(SealError):
            seal.open(bad)
    monkeypatch.setenv(ENV_KEY, KEY)
    assert ReasoningSeal.from_config(None).open(token) == "I think, therefore."
    assert not ReasoningSeal.from_config(None).ephemeral and ReasoningSeal.from_config("flag-key").open(
        ReasoningSeal("flag-key").seal("y")) == "y"
    monkeypatch.delenv(ENV_KEY)
    assert ReasoningSeal.from_config(None).ephemeral
    info = public_info(ServerConfig.from_flat({"reasoning_seal_key": KEY}))
    assert info["reasoning_seal_key"] == "(set)"  # withheld, as the API key


def test_sealed_items_become_reasoning_and_altered_ones_are_400() -> None:
    seal = ReasoningSeal(KEY)
    item = {"type": "reasoning", "summary": [], "encrypted_content": seal.seal("the plan")}
    body = {"input": [{"role": "user", "content": "hi"}, item, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "go"}], "include": ["reasoning.encrypted_content"]}
    chat = to_chat(parse_body(ResponsesRequest, json.dumps(body).encode()), seal=seal)
    assert chat["messages"][1] == {"role": "assistant", "content": "ok", "reasoning_content": "the plan"}
    for token, seal_used in ((_tamper(item["encrypted_content"]), seal), (item["encrypted_content"], None),
                             (item["encrypted_content"], ReasoningSeal("other"))):
        bad = {**body, "input": [body["input"][0], {**item, "encrypted_content": token}, *body["input"][2:]]}
        with pytest.raises(APIError) as e:
            to_chat(parse_body(ResponsesRequest, json.dumps(bad).encode()), seal=seal_used)
        assert e.value.status == 400 and e.value.param == "input" and "does not open" in e.value.message
    with pytest.raises(APIError) as e:
        parse_body(ResponsesRequest, json.dumps({"input": "hi", "include": ["file_search_call.results"]}).encode())
    assert e.value.param == "include"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    args = ["--reasoning-parser", "deepseek-r1", "--reasoning-seal-key", KEY, "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("seal"), timeout=600) as s:
        yield s.base


def test_encrypted_content_round_trips_over_http(base) -> None:
    body = {"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0, "store": False,
            "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}}
    r = httpx.post(base + "/v1/responses", json=body, timeout=120).json()
    item = next(o for o in r["output"] if o["type"] == "reasoning")
    text = item["content"][0]["text"]
    assert text and item["summary"] == [{"type": "summary_text", "text": text}]
    assert ReasoningSeal(KEY).open(item["encrypted_content"]) == text
    with httpx.stream("POST", base + "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
        data = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    done = next(d["item"] for d in data if d["type"] == "response.output_item.done" and d["item"]["type"] == "reasoning")
    assert ReasoningSeal(KEY).open(done["encrypted_content"]) == done["content"][0]["text"] == text
    assert [d["delta"] for d in data if d["type"] == "response.reasoning_summary_text.delta"] == [text]
    plain = httpx.post(base + "/v1/responses", json={**body, "include": []}, timeout=120).json()
    assert "encrypted_content" not in next(o for o in plain["output"] if o["type"] == "reasoning")
    back = [{"role": "user", "content": "Name a colour."}, {"type": "reasoning", "summary": [],
                                                            "encrypted_content": item["encrypted_content"]},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another."}]
    ok = httpx.post(base + "/v1/responses", json={**body, "input": back}, timeout=120)
    assert ok.status_code == 200, ok.text
    back[1]["encrypted_content"] = _tamper(item["encrypted_content"])
    bad = httpx.post(base + "/v1/responses", json={**body, "input": back}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
