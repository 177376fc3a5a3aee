"""The agent APIs' request translations (no server): Anthropic Messages and OpenAI Responses bodies become
the chat-completions request documented in docs/API.md, and what cannot be served is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol_messages import MessagesRequest
from ddtree_serve.server.http.protocol_responses import ResponsesRequest
from ddtree_serve.server.http.serving_common import parse_body
from ddtree_serve.server.http.serving_messages import REFUSED as MESSAGES_REFUSED
from ddtree_serve.server.http.serving_messages import to_chat as messages_to_chat
from ddtree_serve.server.http.serving_responses import REFUSED as RESPONSES_REFUSED
from ddtree_serve.server.http.serving_responses import to_chat as responses_to_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _messages(body: dict) -> dict:
    req = parse_body(MessagesRequest, json.dumps({"max_tokens": 8, **body}).encode())
    return messages_to_chat(req, ServerConfig())


def _responses(body: dict) -> dict:
    return responses_to_chat(parse_body(ResponsesRequest, json.dumps(body).encode()))


def test_messages_history_maps_to_chat_messages() -> None:
    chat = _messages({
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "stop_sequences": ["END"], "top_k": 5, "temperature": 0.5,
        "tools": [{"name": "get_weather", "description": "d", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Looking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                         {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]},
                                         {"type": "text", "text": "Thanks"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "hm",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and chat["temperature"] == 0.5 and chat["max_tokens"] == 8
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                                "description": "d"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    chat_request(chat)  # a valid chat request
    named = _messages({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "f"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    off = _messages({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}})
    assert off["chat_template_kwargs"] == {"thinking": False, "enable_thinking": False}


def test_messages_system_role_messages_merge_into_the_system_prompt() -> None:
    user = {"role": "user", "content": "hi"}
    chat = _messages({"system": "Base.", "messages": [
        user, {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "assistant", "content": "ok"}, {"role": "system", "content": "Late."}, user]})
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "Base."}, {"type": "text", "text": "Reminder."},
                                       {"type": "text", "text": "Late."}]},
        user, {"role": "assistant", "content": "ok"}, user]
    only = _messages({"messages": [{"role": "system", "content": "S."}, user]})
    assert only["messages"] == [{"role": "system", "content": [{"type": "text", "text": "S."}]}, user]
    assert _messages({"system": "S.", "messages": [user]})["messages"][0] == {"role": "system", "content": "S."}
    chat_request(chat)
    with pytest.raises(APIError) as e:  # nothing but system messages
        _messages({"messages": [{"role": "system", "content": "S."}]})
    assert e.value.param == "messages"
    with pytest.raises(APIError) as e:  # a system message holds text only
        _messages({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, user]})
    assert e.value.param == "messages" and "text blocks only" in e.value.message


@pytest.mark.parametrize("field", sorted(MESSAGES_REFUSED))
def test_messages_refused_fields(field) -> None:
    with pytest.raises(APIError) as e:
        _messages({"messages": [{"role": "user", "content": "x"}], field: "x"})
    assert e.value.status == 400 and e.value.param == field and "not supported" in e.value.message


def test_responses_items_map_to_chat_messages() -> None:
    chat = _responses({
        "instructions": "Be brief.", "max_output_tokens": 9, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"city\": \"Rome\"}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                  {"type": "function_call_output", "call_id": "c2", "output": "rain"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "hm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "f",
                                                                      "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    assert chat["max_tokens"] == 9 and chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                              "strict": True}}
    chat_request(chat)
    assert _responses({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_responses_codex_tools() -> None:
    """Namespace tools are flattened (NS__NAME) and their past calls too; other tool types are not offered,
    noted once per type; reasoning.summary is accepted."""
    from ddtree_serve.server.http.responses_tools import map_tools

    notes: list = []
    body = {"input": [{"role": "user", "content": "hi"},
                      {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "collab",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok", "name": "spawn_agent",
                       "namespace": "collab"}],
            "tools": [{"type": "function", "name": "shell", "parameters": SCHEMA}, {"type": "web_search"},
                      {"type": "namespace", "name": "collab", "description": "agents", "tools": [
                          {"type": "function", "name": "spawn_agent", "description": "d", "parameters": SCHEMA}]},
                      {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}, {"type": "web_search"}],
            "reasoning": {"summary": "auto"}, "store": False}
    req = parse_body(ResponsesRequest, json.dumps(body).encode())
    chat = responses_to_chat(req, notes)
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "collab__spawn_agent"]
    assert chat["tools"][1]["function"]["description"] == "d"
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == "collab__spawn_agent"
    assert [k for k, _ in notes] == ["tool:web_search", "tool:custom"]
    chat_request(chat)
    tools = map_tools(req.tools)
    assert tools.call_names("collab__spawn_agent") == {"name": "spawn_agent", "namespace": "collab"}
    assert tools.call_names("shell") == {"name": "shell"}
    for bad in ([{"type": "function", "name": "collab__f"}, {"type": "namespace", "name": "collab", "tools": [
            {"type": "function", "name": "f"}]}], [{"type": "namespace", "name": "n" * 40, "tools": [
                {"type": "function", "name": "f" * 30}]}]):
        with pytest.raises(APIError) as e:
            _responses({"input": "hi", "tools": bad})
        assert e.value.param == "tools", bad


@pytest.mark.parametrize(("extra", "param"), [
    *[({f: "x"}, f) for f in sorted(RESPONSES_REFUSED)],
    ({"store": True}, "store"), ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"), ({"text": {"verbosity": "low"}}, "text")])
def test_responses_refused_fields(extra, param) -> None:
    with pytest.raises(APIError) as e:
        _responses({"input": "hi", **extra})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_store_false_and_empty_include_are_fine() -> None:
    assert _responses({"input": "hi", "store": False, "include": [], "truncation": "disabled"})["messages"]


def test_messages_document_blocks_become_text() -> None:
    chat = _messages({"messages": [{"role": "user", "content": [
        {"type": "document", "title": "T", "context": "C", "source": {"type": "text", "data": "body"}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}},
        {"type": "text", "text": "Summarise."}]}]})
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "T\n\nC\n\nbody"}, {"type": "text", "text": "ab"},
        {"type": "text", "text": "Summarise."}]}]
    for source in ({"type": "base64", "media_type": "application/pdf", "data": "x"}, {"type": "url", "url": "u"}):
        with pytest.raises(APIError, match="plain-text documents"):
            _messages({"messages": [{"role": "user", "content": [{"type": "document", "source": source}]}]})
    with pytest.raises(APIError):  # a document is the user's
        _messages({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            {"type": "document", "source": {"type": "text", "data": "d"}}]}]})
