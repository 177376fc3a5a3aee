"""Kimi's tool-call rules and the thinking fields on a real server: a tiny random Kimi checkpoint with the
stand-in Kimi tokenizer (its template rendering tool answers as Kimi's does, ``## Return of ID``),
``--tool-call-parser kimi_k2 --reasoning-parser kimi_k2``.

- history ids: whatever ids the client sends (chat, Anthropic ``toolu_...``), the prompt holds
  ``functions.NAME:IDX``, the same tokens as Kimi's own ids; an answer to no call is a 400 on every API;
- a call whose name is not among the request's tools comes back as text, streamed and not; with
  ``parallel_tool_calls: false`` and ``tool_choice`` auto the first call is kept (the model's reply is forced
  with an ``ebnf`` grammar, so the random model writes exactly the calls under test; slow: the grammar spells
  the markers out in byte-level tokens, a hundred or more per call);
- ``usage.completion_tokens_details.reasoning_tokens`` (and the include_usage chunk, and Responses'), and
  ``reasoning_effort`` / Responses ``reasoning.effort`` / Anthropic ``thinking`` through the thinking switch.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ddtree_serve.server.parsers.tool_grammar import literal
from tests.server.conftest import running_server
from tests.server.kimi_tokenizer_files import write_tiny_kimi
from tests.server.test_tool_history import CANONICAL, KIMI_TOOL_TEMPLATE, history

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": PARAMS}} for n in ("get_weather", "get_time")]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"thinking": False}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi"
    write_tiny_kimi(path, 512)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": KIMI_TOOL_TEMPLATE}))
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--tool-call-parser", "kimi_k2",
            "--reasoning-parser", "kimi_k2", "--max-total-tokens", "2048", "--log-level", "warning"]
    with running_server(args, tmp_path_factory.mktemp("kimi-rules")) as srv:
        yield srv.base


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _chat(base: str, **body) -> dict:
    r = _post(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, **body) -> list[dict]:
    body = {"messages": USER, "max_tokens": 8, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


def _forced(*calls: str) -> str:
    """EBNF forcing a Kimi tool section with exactly ``calls`` ((header, arguments) text pairs)."""
    body = "".join(f"<|tool_call_begin|>{h}<|tool_call_argument_begin|>{a}<|tool_call_end|>" for h, a in calls)
    return "root ::= " + literal("<|tool_calls_section_begin|>" + body + "<|tool_calls_section_end|>")


# ---- history ids ---------------------------------------------------------------------------------------
def test_history_ids_rewritten_in_the_prompt(base) -> None:
    mixed = history(("call_a1", "toolu_02", "call_a1", "call_a1"))
    common = {"tools": TOOLS, "chat_template_kwargs": OFF}
    chat = _chat(base, messages=mixed, max_tokens=1, **common)
    tok = _post(base, "/tokenize", {"messages": mixed, **common}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"]
    assert _post(base, "/tokenize", {"messages": history(CANONICAL), **common}).json()["tokens"] == tok["tokens"]
    prompt = _post(base, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    assert "call_a1" not in prompt and "toolu_02" not in prompt
    for cid in ("functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2"):
        assert f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>" in prompt and f"## Return of {cid}\n" in prompt
    # the same conversation through Anthropic Messages (toolu ids, tool_result blocks): the same prompt
    use = [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"])} for m in mixed[1:5:3] for c in m["tool_calls"]]
    ant = _post(base, "/v1/messages", {"max_tokens": 1, "temperature": 0, "thinking": {"type": "disabled"},
                                       "tools": [{"name": t["function"]["name"], "input_schema": PARAMS} for t in TOOLS],
                                       "messages": [
        mixed[0],
        {"role": "assistant", "content": use[:2]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_02", "content": "12:00"},
                                     {"type": "tool_result", "tool_use_id": "call_a1", "content": "sunny"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}, use[2]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_a1", "content": "rain"},
                                     {"type": "text", "text": "Thanks"}]}]})
    assert ant.status_code == 200, ant.text
    usage = ant.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]


def test_answer_to_no_call_is_400_on_every_api(base) -> None:
    bad = history(("a", "b", "c", "zzz"))
    r = _post(base, "/v1/chat/completions", {"messages": bad, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "'zzz' matches no tool call" in r.json()["error"]["message"]
    assert _post(base, "/tokenize", {"messages": bad}).json()["error"]["param"] == "messages"
    r = _post(base, "/v1/responses", {"max_output_tokens": 1, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "sunny"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = _post(base, "/v1/messages", {"max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "'toolu_9' matches no tool call" in r.json()["error"]["message"]


# ---- the reply's calls (slow: the forced markup is spelled out a byte-level token at a time) ----------------
BOGUS = ("functions.rm_rf:0", "{}")
PARIS = ("functions.get_weather:0", '{"city": "Paris"}')
ROME = ("functions.get_weather:1", '{"city": "Rome"}')
FORCED = {"tools": TOOLS, "max_tokens": 400, "chat_template_kwargs": OFF}


@pytest.mark.slow
def test_unknown_tool_name_is_text(base) -> None:
    raw = f"<|tool_call_begin|>{BOGUS[0]}<|tool_call_argument_begin|>{BOGUS[1]}<|tool_call_end|>"
    choice = _chat(base, ebnf=_forced(BOGUS, PARIS), **FORCED)["choices"][0]
    assert choice["message"]["content"] == raw, choice
    assert [(c["id"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [PARIS]
    assert choice["finish_reason"] == "tool_calls"
    only = _chat(base, ebnf=_forced(BOGUS), **FORCED)["choices"][0]
    assert only["message"]["content"] == raw and only["message"]["tool_calls"] is None
    assert only["finish_reason"] == "stop", only  # no call: not tool_calls
    deltas = [c["delta"] for ch in _stream(base, ebnf=_forced(BOGUS), **FORCED) for c in ch["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == raw
    assert not any(d.get("tool_calls") for d in deltas)


@pytest.mark.slow
def test_parallel_false_keeps_the_first_call(base) -> None:
    body = {"ebnf": _forced(PARIS, ROME), **FORCED}
    both = _chat(base, **body)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in both] == [PARIS[1], ROME[1]]
    one = _chat(base, parallel_tool_calls=False, **body)["choices"][0]
    assert [(c["id"], c["function"]["arguments"]) for c in one["message"]["tool_calls"]] == [PARIS]
    assert one["finish_reason"] == "tool_calls" and not one["message"]["content"]
    calls = [tc for ch in _stream(base, parallel_tool_calls=False, **body) for c in ch["choices"]
             for tc in c["delta"].get("tool_calls") or []]
    assert {tc["index"] for tc in calls} == {0} and [tc["id"] for tc in calls if tc.get("id")] == [PARIS[0]]
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == PARIS[1]


# ---- thinking --------------------------------------------------------------------------------------------
def _prompt_len(base: str, **kwargs) -> int:
    return _post(base, "/tokenize", {"messages": USER, "chat_template_kwargs": kwargs}).json()["count"]


def test_reasoning_tokens(base) -> None:
    chat = _chat(base, max_tokens=4)
    reasoning = chat["choices"][0]["message"]["reasoning_content"]
    assert reasoning  # thinking on: the random model's text stays inside <think>
    count = _post(base, "/tokenize", {"prompt": reasoning, "add_special_tokens": False}).json()["count"]
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": count} and count > 0
    chunks = _stream(base, max_tokens=4, stream_options={"include_usage": True})
    assert "".join(c["delta"].get("reasoning_content") or "" for ch in chunks for c in ch["choices"]) == reasoning
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": count}


@pytest.mark.slow
def test_reasoning_tokens_elsewhere(base) -> None:
    chat = _chat(base)
    count = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    resp = _post(base, "/v1/responses", {"input": USER[0]["content"], "max_output_tokens": 8, "temperature": 0})
    assert resp.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == count > 0
    assert _chat(base, chat_template_kwargs=OFF)["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert _chat(base, separate_reasoning=False)["usage"]["completion_tokens_details"] is None  # no parser: none


def test_reasoning_effort_and_thinking_switch(base) -> None:
    on, off = _prompt_len(base), _prompt_len(base, thinking=False)
    assert off == on + 2  # the generation prompt ends with <think></think>
    none = _chat(base, max_tokens=1, reasoning_effort="none")
    assert none["usage"]["prompt_tokens"] == off and none["choices"][0]["message"]["reasoning_content"] is None
    r = _post(base, "/v1/chat/completions", {"messages": USER, "reasoning_effort": "none",
                                             "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    resp = _post(base, "/v1/responses", {"input": USER[0]["content"], "max_output_tokens": 1,
                                         "reasoning": {"effort": "minimal"}}).json()
    assert resp["usage"]["input_tokens"] == off and [o["type"] for o in resp["output"]] == ["message"], resp
    r = _post(base, "/v1/messages", {"messages": USER, "max_tokens": 8,
                                     "thinking": {"type": "enabled", "budget_tokens": 4}})
    # Claude Code's budget below max_tokens (issue 61): accepted, thinking on; the budget does not bound it
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "thinking", r.text


@pytest.mark.slow
def test_effort_levels_and_anthropic_thinking_enabled(base) -> None:
    on, off = _prompt_len(base), _prompt_len(base, thinking=False)
    for effort, expected in (("minimal", off), ("low", on), ("medium", on), ("high", on), ("xhigh", on)):
        assert _chat(base, max_tokens=1, reasoning_effort=effort)["usage"]["prompt_tokens"] == expected, effort
    r = _post(base, "/v1/messages", {"messages": USER, "max_tokens": 8,
                                     "thinking": {"type": "enabled", "budget_tokens": 8}})
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "thinking", r.text
    assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == on
