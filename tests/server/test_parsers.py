"""Streaming parsers: feeding any split of the text gives exactly the whole-text result."""

from __future__ import annotations

import itertools
import json

import pytest

from ddtree_serve.server.parsers import ReasoningParser, ToolCallParser, parse_reasoning, parse_tool_calls
from ddtree_serve.server.parsers.tool_call import merge_deltas

KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris", "unit": "°C"}<|tool_call_end|><|tool_call_begin|>functions.search:1'
             '<|tool_call_argument_begin|>{"q": "a<b"}<|tool_call_end|><|tool_calls_section_end|>')

TOOL_TEXTS = {
    "kimi_k2": [
        "Let me check." + KIMI_CALL,
        KIMI_CALL + " done",
        "no tools here, just <|tool text",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"x\": 1",  # cut off
    ],
    "hermes": [
        'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"k": [1]}}</tool_call>',
        "text <tool_call>not json</tool_call> more <tool",
    ],
}


def _stream_tools(kind: str, pieces: list[str]) -> tuple[str, list]:
    p = ToolCallParser(kind)
    text, deltas = "", []
    for piece in pieces:
        t, d = p.feed(piece)
        text, deltas = text + t, deltas + d
    t, d = p.finish()
    return text + t, merge_deltas(deltas + d)


def _splits(text: str, max_cuts: int = 2):
    """All ways to cut ``text`` at one point, and at two points for short texts, plus char by char."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
    if n <= 60 and max_cuts >= 2:
        for i, j in itertools.combinations(range(1, n), 2):
            yield [text[:i], text[i:j], text[j:]]


def _same_calls(a, b) -> bool:  # hermes ids are random: compare names and arguments
    return [(c.name, c.arguments) for c in a] == [(c.name, c.arguments) for c in b]


@pytest.mark.parametrize("kind,text", [(k, t) for k, ts in TOOL_TEXTS.items() for t in ts])
def test_tool_call_stream_equals_whole(kind: str, text: str) -> None:
    whole_text, whole_calls = parse_tool_calls(kind, text)
    for pieces in _splits(text):
        t, calls = _stream_tools(kind, pieces)
        assert t == whole_text, pieces
        assert _same_calls(calls, whole_calls), pieces


def test_kimi_tool_calls_parsed() -> None:
    text, calls = parse_tool_calls("kimi_k2", "Let me check." + KIMI_CALL)
    assert text == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "°C"}


def test_kimi_streams_arguments_incrementally() -> None:
    p = ToolCallParser("kimi_k2")
    _, d1 = p.feed("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\"")
    assert d1[0].name == "f" and d1[0].id == "functions.f:0"
    assert "".join(d.arguments for d in d1) == '{"a"'
    _, d2 = p.feed(": 1}<|tool_call_e")  # a partial end marker is held back, never shown as arguments
    assert "".join(d.arguments for d in d2) == ": 1}"
    _, d3 = p.feed("nd|><|tool_calls_section_end|>")
    assert d3 == [] and p.num_calls == 1


def test_hermes_invalid_json_stays_text() -> None:
    text, calls = parse_tool_calls("hermes", "a<tool_call>oops</tool_call>b")
    assert calls == [] and text == "a<tool_call>oops</tool_call>b"


REASONING_TEXTS = [
    ("deepseek-r1", "<think>Let me think.</think>The answer is 4."),
    ("deepseek-r1", "Reasoning without the opening tag</think>\n\nAnswer"),
    ("deepseek-r1", "still thinking, cut off"),
    ("kimi_k2", "<think>I should call a tool." + KIMI_CALL),  # tool section opened inside <think>
    ("kimi_k2", "  <think>a</think>b"),
    ("kimi_k2", "<thi"),
]


@pytest.mark.parametrize("kind,text", REASONING_TEXTS)
def test_reasoning_stream_equals_whole(kind: str, text: str) -> None:
    whole = parse_reasoning(kind, text)
    for pieces in _splits(text):
        p = ReasoningParser(kind)
        r, c = "", ""
        for piece in pieces:
            dr, dc = p.feed(piece)
            r, c = r + dr, c + dc
        dr, dc = p.finish()
        assert (r + dr, c + dc) == whole, pieces


def test_reasoning_values() -> None:
    assert parse_reasoning("deepseek-r1", "<think>x</think>y") == ("x", "y")
    assert parse_reasoning("deepseek-r1", "x</think>y") == ("x", "y")
    assert parse_reasoning("kimi_k2", "<think>x</think>y", thinking=False) == ("", "<think>x</think>y")
    r, c = parse_reasoning("kimi_k2", "<think>plan" + KIMI_CALL)
    assert r == "plan" and c == KIMI_CALL


def test_kimi_tool_section_inside_think_end_to_end() -> None:
    """Reasoning parser then tool parser, streamed in every 2-way split: reasoning, no content, two calls."""
    text = "<think>I need the weather." + KIMI_CALL
    for pieces in _splits(text, max_cuts=1):
        rp, tp = ReasoningParser("kimi_k2"), ToolCallParser("kimi_k2")
        reasoning, content, deltas = "", "", []
        for piece in pieces + [None]:
            dr, dc = rp.feed(piece) if piece is not None else rp.finish()
            ct, dd = tp.feed(dc) if piece is not None else tp.feed(dc)
            if piece is None:
                ct2, dd2 = tp.finish()
                ct, dd = ct + ct2, dd + dd2
            reasoning, content, deltas = reasoning + dr, content + ct, deltas + dd
        calls = merge_deltas(deltas)
        assert reasoning == "I need the weather."
        assert content == ""
        assert [c.name for c in calls] == ["get_weather", "search"]


def test_unknown_parser_names() -> None:
    with pytest.raises(ValueError):
        ToolCallParser("nope")
    with pytest.raises(ValueError):
        ReasoningParser("nope")


def test_cut_calls_keep_their_text_and_finish_length() -> None:
    """A reply cut by max_tokens (issue 38): a Kimi call cut inside its header is content, not a call; one cut
    inside its arguments keeps them (already streamed); a cut hermes call is content; the finish reason is
    the engine's ``length`` whatever was parsed, ``tool_calls`` only for a reply that ended by itself."""
    from ddtree_serve.server.http.serving_chat import _finish_reason

    text, calls = parse_tool_calls("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_w")
    assert calls == [] and text == "<|tool_call_begin|>functions.get_w"
    text, calls = parse_tool_calls("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                                              "<|tool_call_argument_begin|>{\"city\": \"Par")
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"city": "Par')] and text == ""
    text, calls = parse_tool_calls("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert calls == [] and text == '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    assert _finish_reason("length", True) == "length" and _finish_reason("abort", True) == "abort"
    assert _finish_reason("stop", True) == "tool_calls" and _finish_reason("stop", False) == "stop"
