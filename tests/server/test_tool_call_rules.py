"""The request's rules in the tool-call parsers (ddtree_serve/server/parsers/tool_call.py), both formats, streamed in
every split and whole: a call whose name is not among the request's tools is text, never a call (bogus or
malformed Kimi headers included); with ``max_calls`` (``parallel_tool_calls: false``) the first call is
kept and the later ones dropped; call indices count the calls returned only."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.server.parsers import ToolCallParser, parse_tool_calls
from ddtree_serve.server.parsers.tool_call import merge_deltas


def kimi_call(header: str, args: str) -> str:
    return f"<|tool_call_begin|>{header}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


WEATHER = kimi_call("functions.get_weather:0", '{"city": "Paris"}')
BOGUS = kimi_call("functions.rm_rf:1", '{"path": "/"}')
MALFORMED = kimi_call("functionsexec5", '{"command": "ls"}')  # sglang #21377: a header without '.' and ':'
TIME = kimi_call("functions.get_time:2", '{"tz": "UTC"}')
NAMES = ("get_weather", "get_time")

# (kind, text, tool_names, max_calls, expected content, expected [(index, name, arguments)])
CASES = [
    ("kimi_k2", "Sure." + kimi_section(WEATHER, BOGUS, TIME), NAMES, None,
     "Sure." + BOGUS, [(0, "get_weather", '{"city": "Paris"}'), (1, "get_time", '{"tz": "UTC"}')]),
    ("kimi_k2", kimi_section(MALFORMED), NAMES, None, MALFORMED, []),
    ("kimi_k2", kimi_section(BOGUS, TIME, WEATHER), NAMES, 1, BOGUS, [(0, "get_time", '{"tz": "UTC"}')]),
    ("kimi_k2", kimi_section(WEATHER, TIME) + " done", NAMES, 1, " done", [(0, "get_weather", '{"city": "Paris"}')]),
    ("kimi_k2", kimi_section(WEATHER, TIME), None, None, "",  # no rules: every call, as before
     [(0, "get_weather", '{"city": "Paris"}'), (1, "get_time", '{"tz": "UTC"}')]),
    ("kimi_k2", "<|tool_calls_section_begin|>" + kimi_call("functions.nope:0", '{"a": 1}')[:-len("<|tool_call_end|>")],
     NAMES, None, kimi_call("functions.nope:0", '{"a": 1}')[:-len("<|tool_call_end|>")], []),  # cut: its text
    ("hermes", "a" + hermes_call("get_weather", {"city": "Paris"}) + hermes_call("rm_rf", {"path": "/"}) + "b",
     NAMES, None, "a" + hermes_call("rm_rf", {"path": "/"}) + "b", [(0, "get_weather", '{"city": "Paris"}')]),
    ("hermes", hermes_call("rm_rf", {}) + hermes_call("get_time", {"tz": "UTC"}) + hermes_call("get_weather", {}),
     NAMES, 1, hermes_call("rm_rf", {}), [(0, "get_time", '{"tz": "UTC"}')]),
]


def _stream(kind: str, pieces: list[str], names, max_calls) -> tuple[str, list]:
    p = ToolCallParser(kind, names, max_calls)
    text, deltas = "", []
    for piece in pieces:
        t, d = p.feed(piece)
        text, deltas = text + t, deltas + d
    t, d = p.finish()
    assert p.num_calls == len(merge_deltas(deltas + d))
    return text + t, merge_deltas(deltas + d)


@pytest.mark.parametrize(("kind", "text", "names", "max_calls", "content", "calls"), CASES)
def test_rules_whole_and_streamed(kind, text, names, max_calls, content, calls) -> None:
    got_text, got_calls = parse_tool_calls(kind, text, names, max_calls)
    assert got_text == content
    assert [(c.name, c.arguments) for c in got_calls] == [(n, a) for _, n, a in calls]
    splits = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        t, streamed = _stream(kind, pieces, names, max_calls)
        assert t == content, pieces
        assert [(c.name, c.arguments) for c in streamed] == [(n, a) for _, n, a in calls], pieces


def test_indices_and_ids_count_returned_calls_only() -> None:
    p = ToolCallParser("kimi_k2", NAMES)
    _, deltas = p.feed(kimi_section(BOGUS, TIME, BOGUS, WEATHER))
    firsts = [d for d in deltas if d.name]
    assert [(d.index, d.name, d.id) for d in firsts] == [(0, "get_time", "functions.get_time:2"),
                                                           (1, "get_weather", "functions.get_weather:0")]
    assert {d.index for d in deltas} == {0, 1} and p.num_calls == 2


def test_unknown_name_streams_as_text_as_it_arrives() -> None:
    """The bogus call's text is content as soon as its header is complete (not held to the end)."""
    p = ToolCallParser("kimi_k2", NAMES)
    t1, d1 = p.feed("<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{\"pa")
    assert d1 == [] and t1 == "<|tool_call_begin|>functions.rm_rf:0<|tool_call_argument_begin|>{\"pa"
    t2, d2 = p.feed('th": 1}<|tool_call_end|><|tool_calls_section_end|>')
    assert d2 == [] and t2 == 'th": 1}<|tool_call_end|>' and p.num_calls == 0
