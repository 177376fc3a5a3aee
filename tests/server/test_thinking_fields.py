"""The thinking fields without a server (ddtree_serve/server/http/thinking.py and the agent translations): chat's
``reasoning_effort`` goes through the template's thinking switch or is a 400 naming it; Responses'
``reasoning.effort`` becomes it (``reasoning.summary`` is refused); Anthropic ``thinking`` enabled is served
where its ``budget_tokens`` cannot bind (at least ``max_tokens``) and refused where it would have to."""

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
    for key in ("summary", "generate_summary"):
        with pytest.raises(APIError) as e:
            _responses({"reasoning": {"effort": "high", key: "auto"}})
        assert e.value.param == "reasoning" and "summarized" in e.value.message
    with pytest.raises(APIError) as e:
        parse_body(ResponsesRequest, json.dumps({"input": "hi", "reasoning": {"effort": "max"}}).encode())
    assert e.value.param == "reasoning"


def _messages(body: dict, reasoning_parser: str | None = "kimi_k2") -> dict:
    req = parse_body(MessagesRequest, json.dumps({"max_tokens": 64, "messages": USER, **body}).encode())
    return messages_to_chat(req, ServerConfig.from_flat({"reasoning_parser": reasoning_parser}))


def test_messages_thinking_enabled() -> None:
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 64},
                     {"type": "enabled", "budget_tokens": 4096}, {"type": "adaptive"}):
        chat = _messages({"thinking": thinking})  # thinking on: the thinking model's default
        assert "chat_template_kwargs" not in chat and "reasoning_effort" not in chat, thinking
    refused = [({"type": "enabled", "budget_tokens": 63}, "thinking.budget_tokens (63) below max_tokens (64)"),
               ({"type": "between_tools"}, "between_tools"), ({"type": "adaptive", "display": "omitted"}, "omitted")]
    for thinking, words in refused:
        with pytest.raises(APIError) as e:
            _messages({"thinking": thinking})
        assert e.value.status == 400 and e.value.param == "thinking" and words in e.value.message, e.value.message
    with pytest.raises(APIError) as e:
        _messages({"thinking": {"type": "enabled", "budget_tokens": 4096}}, reasoning_parser=None)
    assert "without a reasoning parser" in e.value.message
