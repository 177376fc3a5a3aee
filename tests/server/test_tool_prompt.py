"""Tools the model can see (issue 61 item 2; ddtree_serve/server/http/tool_prompt.py): a chat template that
renders no tools gets the tool list written into the system turn in the tool-call parser's format, and the
history's calls and results as text in that format; a template that renders tools is left to do it. Over
HTTP (default model, whose template renders no tools, hermes parser): the prompt of a request with tools
holds them, /tokenize and count_tokens agree with it."""

from __future__ import annotations

import json

import httpx
import pytest

from ddtree_serve.server.http.tool_prompt import template_reads_tools, tools_in_system, tools_text
from tests.server.conftest import running_server
from tests.server.kimi_tokenizer_files import CHAT_TEMPLATE as KIMI_TEMPLATE

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SMOL = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}")


def test_which_templates_read_tools() -> None:
    assert template_reads_tools(KIMI_TEMPLATE)
    assert not template_reads_tools(SMOL)
    assert template_reads_tools({"default": KIMI_TEMPLATE}) and not template_reads_tools({"default": SMOL})
    assert template_reads_tools(None) and template_reads_tools("{% if %}")  # nothing to write into


def test_hermes_tools_and_history_as_text() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "Looking.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = tools_in_system(history, [TOOL], "hermes")
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and f"<tools>\n{json.dumps(TOOL)}\n</tools>" in system
    assert "<tool_call>" in system and "</tool_call>" in system
    assert out[2] == {"role": "assistant", "content": 'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris"}}\n</tool_call>'}
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    assert history[2]["tool_calls"]  # the input is not changed
    bare = tools_in_system([{"role": "user", "content": "hi"}], [TOOL], "hermes")
    assert bare[0] == {"role": "system", "content": tools_text([TOOL], "hermes")} and bare[1]["role"] == "user"


def test_kimi_format() -> None:
    out = tools_in_system([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}], [TOOL], "kimi_k2")
    assert "<|tool_call_begin|>functions.NAME:IDX" in out[0]["content"]
    assert out[2]["content"] == ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                                 "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    assert out[3]["content"] == "## Return of functions.get_weather:0\nsunny"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ddtree_serve.model_executor.default_model import ensure_default_model

    ensure_default_model()
    with running_server(["--tool-call-parser", "hermes", "--dtype", "float32"], tmp_path_factory.mktemp("tp")) as s:
        assert "the chat template renders no tools" in s.log.read_text()
        yield s.base


def test_tools_reach_the_prompt(base) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = httpx.post(base + "/tokenize", json={"messages": msgs, "tools": [TOOL], "return_token_strs": True},
                            timeout=60).json()
    without = httpx.post(base + "/tokenize", json={"messages": msgs}, timeout=60).json()
    assert with_tools["count"] > without["count"] + 40  # the tool list is in the prompt
    text = httpx.post(base + "/detokenize", json={"tokens": with_tools["tokens"]}, timeout=60).json()["text"]
    assert "<tools>" in text and "get_weather" in text and "<tool_call>" in text
    chat = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "tools": [TOOL], "max_tokens": 1},
                      timeout=120).json()
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]
    counted = httpx.post(base + "/v1/messages/count_tokens", json={"messages": msgs, "tools": [
        {"name": "get_weather", "description": "Weather in a city", "input_schema": TOOL["function"]["parameters"]}]},
        timeout=60).json()
    assert counted["input_tokens"] == with_tools["count"]
    none = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "tools": [TOOL], "tool_choice": "none",
                                                           "max_tokens": 1}, timeout=120).json()
    assert none["usage"]["prompt_tokens"] == without["count"]  # tool_choice none: no tools offered
