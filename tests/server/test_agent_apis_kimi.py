"""The agent APIs on Kimi's template and parsers: a tiny random Kimi checkpoint with the stand-in Kimi
tokenizer (tests/server/kimi_tokenizer_files.py), ``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2``.
The reasoning comes back as Anthropic ``thinking`` blocks (streamed as ``thinking_delta``) and as a Responses
``reasoning`` item; a history with tool_use / tool_result blocks (or function_call items) renders through
Kimi's template to exactly the prompt chat completions builds, and the greedy reply is the same text."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import running_server
from tests.server.kimi_tokenizer_files import write_tiny_kimi

pytestmark = pytest.mark.slow  # a second server (~20 s); the default-model module covers the same paths

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"id": "functions.get_weather:0", "name": "get_weather", "input": {"city": "Paris"}}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi"
    write_tiny_kimi(path, 512)
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--tool-call-parser", "kimi_k2",
            "--reasoning-parser", "kimi_k2", "--max-total-tokens", "2048", "--log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("kimi-agents")) as srv:
        yield srv.base


def _model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def test_reasoning_is_thinking_block_and_reasoning_item(base) -> None:
    model = _model(base)
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
        "temperature": 0}).json()["choices"][0]["message"]
    assert chat["reasoning_content"]  # thinking on: the random model's text stays inside <think>
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    kw = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
          "extra_body": {"temperature": 0}}
    m = ant.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking == chat["reasoning_content"]
    assert "".join(b.text for b in m.content if b.type == "text") == (chat["content"] or "")
    with ant.messages.stream(**kw) as s:
        thinking = "".join(ev.delta.thinking for ev in s if ev.type == "content_block_delta"
                           and ev.delta.type == "thinking_delta")
    assert thinking == chat["reasoning_content"]
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = oai.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == chat["reasoning_content"]
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_tool_history_renders_like_chat_on_kimi_template(base) -> None:
    model = _model(base)
    tools_c = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": model, "tools": tools_c, "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": "I should look it up.", "tool_calls": [
                {"id": CALL["id"], "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": json.dumps(CALL["input"])}}]},
            {"role": "tool", "tool_call_id": CALL["id"], "content": "18 degrees"}]}).json()
    ant = httpx.post(f"{base}/v1/messages", timeout=120, json={
        "model": model, "tools": [{"name": "get_weather", "input_schema": WEATHER}], "max_tokens": 6,
        "temperature": 0, "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should look it up.",
                                               "signature": ""}, {"type": "tool_use", **CALL}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL["id"],
                                          "content": [{"type": "text", "text": "18 degrees"}]}]}]}).json()
    resp = httpx.post(f"{base}/v1/responses", timeout=120, json={
        "model": model, "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "max_output_tokens": 6, "temperature": 0, "input": [
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                              "text": "I should look it up."}]},
            {"type": "function_call", "call_id": CALL["id"], "name": "get_weather",
             "arguments": json.dumps(CALL["input"])},
            {"type": "function_call_output", "call_id": CALL["id"], "output": "18 degrees"}]}).json()
    prompt = chat["usage"]["prompt_tokens"]
    assert ant["usage"]["input_tokens"] + ant["usage"]["cache_read_input_tokens"] == prompt
    assert resp["usage"]["input_tokens"] == prompt
    msg = chat["choices"][0]["message"]
    assert [b.get("thinking") for b in ant["content"] if b["type"] == "thinking"] == [msg["reasoning_content"]]
    assert "".join(b["text"] for b in ant["content"] if b["type"] == "text") == (msg["content"] or "")
    assert "".join(c["text"] for o in resp["output"] if o["type"] == "message" for c in o["content"]) == (
        msg["content"] or "")
    assert [o["content"][0]["text"] for o in resp["output"] if o["type"] == "reasoning"] == [
        msg["reasoning_content"]]



def test_kimi_tool_ids_round_trip_unchanged(base) -> None:
    """An id as Kimi emits it (``functions.NAME:IDX``, numbered the model's own way: here 3 for the first call of
    the conversation) comes back unchanged through chat and Messages (issue 46 item 8; it was renumbered to 0):
    in the prompt /tokenize renders for chat, and /v1/messages/count_tokens counts that same prompt."""
    model = _model(base)
    tools_c = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    call = {"id": "functions.get_weather:3", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(CALL["input"])}}
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}]
    tok = httpx.post(f"{base}/tokenize", timeout=60, json={"model": model, "messages": history, "tools": tools_c,
                                                           "chat_template_kwargs": {"thinking": False}}).json()
    text = httpx.post(f"{base}/detokenize", timeout=60, json={"model": model, "tokens": tok["tokens"]}).json()["prompt"]
    assert text.count(call["id"]) >= 1 and "functions.get_weather:0" not in text
    ant_history = [{"role": "user", "content": QUESTION},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather",
                                                      "input": CALL["input"]}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                                 "content": "18 degrees"}]}]
    counted = httpx.post(f"{base}/v1/messages/count_tokens", timeout=60, json={
        "model": model, "tools": [{"name": "get_weather", "input_schema": WEATHER}], "messages": ant_history,
        "thinking": {"type": "disabled"}}).json()
    assert counted["input_tokens"] == tok["count"]
