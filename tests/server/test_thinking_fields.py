"""The thinking fields without a server (ddtree_serve/server/http/thinking.py and the agent translations): chat's
``reasoning_effort`` goes through the template's thinking switch or is a 400 naming it; Responses'
``reasoning.effort`` becomes it (``reasoning.summary`` is accepted); Anthropic ``thinking`` and
``output_config.effort`` go through the thinking switch where the model has one and are accepted (noted for
a log-once line) where it has none; ``context_management`` is accepted and noted."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol_messages import MessagesRequest
from ddtree_serve.server.http.protocol_responses import ResponsesRequest
from ddtree_serve.server.http.serving_common import parse_body
from ddtree_serve.server.http.serving_messages import to_chat as messages_to_chat
from ddtree_serve.server.http.serving_responses import to_chat as responses_to_chat
from ddtree_serve.server.http.thinking import EFFORT_LEVELS, apply_reasoning_effort, template_switches
from tests.server.kimi_tokenizer_files import CHAT_TEMPLATE as KIMI_TEMPLATE

QWEN_STYLE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %}<think></think>{% endif %}"
NO_SWITCH = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
USER = [{"role": "user", "content": "hi"}]


def _req(**body):
    return chat_request({"messages": USER, **body})


def test_template_switches() -> None:
    assert template_switches(KIMI_TEMPLATE) == ("thinking",)
    assert template_switches(QWEN_STYLE) == ("enable_thinking",)
    assert template_switches(NO_SWITCH) == () and template_switches(None) == ()
    assert template_switches({"default": KIMI_TEMPLATE, "tool_use": NO_SWITCH}) == ("thinking",)
    assert template_switches("{% if %}") == ()  # not a template: no switch


def test_reasoning_effort_maps_to_the_switch() -> None:
    assert EFFORT_LEVELS == ("none", "minimal", "low", "medium", "high", "xhigh")
    for effort in EFFORT_LEVELS:
        on = effort not in ("none", "minimal")
        req = apply_reasoning_effort(_req(reasoning_effort=effort), "kimi_k2", KIMI_TEMPLATE)
        assert req.chat_template_kwargs == {"thinking": on}, effort
        qwen = apply_reasoning_effort(_req(reasoning_effort=effort), "deepseek-r1", QWEN_STYLE)
        assert qwen.chat_template_kwargs == {"enable_thinking": on}, effort
    kept = apply_reasoning_effort(_req(reasoning_effort="none", chat_template_kwargs={"thinking": False, "x": 1}),
                                  "kimi_k2", KIMI_TEMPLATE)
    assert kept.chat_template_kwargs == {"thinking": False, "x": 1}
    plain = _req(chat_template_kwargs={"thinking": True})
    assert apply_reasoning_effort(plain, None, None) is plain  # no reasoning_effort: nothing to apply


@pytest.mark.parametrize(("body", "parser", "template", "words"), [
    ({"reasoning_effort": "high"}, None, KIMI_TEMPLATE, "without a reasoning parser"),
    ({"reasoning_effort": "none"}, "kimi_k2", NO_SWITCH, "no thinking switch"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}}, "kimi_k2", KIMI_TEMPLATE,
     "chat_template_kwargs.thinking"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}, "kimi_k2", KIMI_TEMPLATE,
     "chat_template_kwargs.enable_thinking"),
])
def test_reasoning_effort_refusals_name_the_field(body, parser, template, words) -> None:
    with pytest.raises(APIError) as e:
        apply_reasoning_effort(_req(**body), parser, template)
    assert e.value.status == 400 and e.value.param == "reasoning_effort" and words in e.value.message, e.value.message


def test_reasoning_effort_values_are_validated() -> None:
    with pytest.raises(APIError) as e:
        _req(reasoning_effort="extreme")
    assert e.value.param == "reasoning_effort"


def _responses(body: dict) -> dict:
    return responses_to_chat(parse_body(ResponsesRequest, json.dumps({"input": "hi", **body}).encode()))


def test_responses_reasoning() -> None:
    assert _responses({"reasoning": {"effort": "minimal"}})["reasoning_effort"] == "minimal"
    assert "reasoning_effort" not in _responses({"reasoning": {}})
    for key in ("summary", "generate_summary"):  # accepted: the reasoning item's summary is the whole reasoning
        assert _responses({"reasoning": {"effort": "high", key: "auto"}})["reasoning_effort"] == "high"
    with pytest.raises(APIError) as e:
        parse_body(ResponsesRequest, json.dumps({"input": "hi", "reasoning": {"effort": "max"}}).encode())
    assert e.value.param == "reasoning"


def _messages(body: dict, reasoning_parser: str | None = "kimi_k2", template: str | None = KIMI_TEMPLATE,
              notes: list | None = None) -> dict:
    req = parse_body(MessagesRequest, json.dumps({"max_tokens": 64, "messages": USER, **body}).encode())
    return messages_to_chat(req, ServerConfig.from_flat({"reasoning_parser": reasoning_parser}), template, notes)


def test_messages_thinking_enabled() -> None:
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 64},
                     {"type": "enabled", "budget_tokens": 4096}, {"type": "adaptive"}):
        notes: list = []
        chat = _messages({"thinking": thinking}, notes=notes)  # thinking on: the thinking model's default
        assert "chat_template_kwargs" not in chat and "reasoning_effort" not in chat, thinking
        assert notes == [], thinking
    notes = []  # Claude Code's budget below max_tokens: accepted, noted (it does not bound the reasoning)
    assert "chat_template_kwargs" not in _messages({"thinking": {"type": "enabled", "budget_tokens": 63}},
                                                   notes=notes)
    assert [k for k, _ in notes] == ["thinking.budget_tokens"]
    refused = [({"type": "between_tools"}, "between_tools"), ({"type": "adaptive", "display": "omitted"}, "omitted")]
    for thinking, words in refused:
        with pytest.raises(APIError) as e:
            _messages({"thinking": thinking})
        assert e.value.status == 400 and e.value.param == "thinking" and words in e.value.message, e.value.message


@pytest.mark.parametrize("kind", ["enabled", "adaptive"])
def test_messages_thinking_without_a_reasoning_parser_is_accepted_and_noted(kind) -> None:
    notes: list = []
    chat = _messages({"thinking": {"type": kind, "budget_tokens": 31999}}, reasoning_parser=None, notes=notes)
    assert "chat_template_kwargs" not in chat and "reasoning_effort" not in chat
    assert [k for k, _ in notes] == ["thinking"] and "without a reasoning parser" in notes[0][1]


def test_messages_effort_maps_to_the_thinking_switch() -> None:
    for effort, chat_effort in (("low", "low"), ("medium", "medium"), ("high", "high"), ("max", "xhigh")):
        notes: list = []
        chat = _messages({"output_config": {"effort": effort}}, notes=notes)
        assert chat["reasoning_effort"] == chat_effort and notes == []
        applied = apply_reasoning_effort(chat_request(chat), "kimi_k2", KIMI_TEMPLATE)
        assert applied.chat_template_kwargs == {"thinking": True}
    # accepted with no effect (noted): no reasoning parser, a template without a switch, thinking disabled
    for kw in ({"reasoning_parser": None}, {"template": NO_SWITCH}):
        notes = []
        chat = _messages({"output_config": {"effort": "high"}, "thinking": {"type": "adaptive"}}, notes=notes, **kw)
        assert "reasoning_effort" not in chat and any(k.startswith("output_config.effort") for k, _ in notes), kw
    notes = []
    chat = _messages({"output_config": {"effort": "low"}, "thinking": {"type": "disabled"}}, notes=notes)
    assert "reasoning_effort" not in chat and chat["chat_template_kwargs"]["thinking"] is False
    assert "thinking is disabled" in notes[0][1]
    with pytest.raises(APIError) as e:
        _messages({"output_config": {"effort": "extreme"}})
    assert e.value.param == "output_config"


def test_messages_context_management_is_accepted_and_noted() -> None:
    notes: list = []
    body = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    chat = _messages(body, notes=notes)
    assert "context_management" not in chat and [k for k, _ in notes] == ["context_management"]


def test_moonshot_thinking_field_sets_the_switch() -> None:
    from ddtree_serve.server.http.thinking import apply_thinking_field

    for kind, on in (("enabled", True), ("disabled", False)):
        req = apply_thinking_field(_req(thinking={"type": kind}, chat_template_kwargs={"x": 1}))
        assert req.chat_template_kwargs == {"x": 1, "thinking": on, "enable_thinking": on}
    same = apply_thinking_field(_req(thinking={"type": "disabled"}, reasoning_effort="none",
                                     chat_template_kwargs={"thinking": False}))
    assert same.chat_template_kwargs["thinking"] is False
    plain = _req()
    assert apply_thinking_field(plain) is plain
    for body in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "high"}):
        with pytest.raises(APIError) as e:
            apply_thinking_field(_req(thinking={"type": "disabled"}, **body))
        assert e.value.status == 400 and e.value.param == "thinking", body
    for bad in ({"type": "auto"}, {"type": "enabled", "keep": "all"}, {}):
        with pytest.raises(APIError) as e:
            _req(thinking=bad)
        assert e.value.param == "thinking", bad


def test_unknown_fields_are_recorded() -> None:
    from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest

    body = {"messages": USER, "user": "u", "preserve_thinking": True, "foo": None, "temperature": None}
    assert parse_body(ChatCompletionRequest, json.dumps(body).encode()).unknown_fields == ("preserve_thinking", "foo")
    assert parse_body(CompletionRequest, b'{"prompt": "x", "bar": 1}').unknown_fields == ("bar",)
    assert _req().unknown_fields == ()
