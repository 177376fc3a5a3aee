"""Kimi's tool-call ids in the history (ddtree_serve/server/http/tool_history.py), without a server: every call id becomes
``functions.NAME:IDX`` (IDX running over the conversation; ids the model itself wrote are kept) and every tool
answer the id of the call it answers, whatever ids the client sent; rendered through the Kimi stand-in tokenizer with a template that
shows the ids where Kimi's does (``<|tool_call_begin|>ID`` and ``## Return of ID``)."""

from __future__ import annotations

import json

import pytest

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.tool_history import kimi_tool_ids, template_messages
from tests.server.kimi_tokenizer_files import CHAT_TEMPLATE, write_kimi_tokenizer

# The stand-in's template, with a tool answer rendered as Kimi's template renders it (``## Return of ID``)
KIMI_TOOL_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if m.content is string -%}{{ m.content }}",
    "{%- if m.role == 'tool' -%}## Return of {{ m.tool_call_id }}{{ '\\n' }}{%- endif -%}"
    "{%- if m.content is string -%}{{ m.content }}", 1)
assert KIMI_TOOL_TEMPLATE != CHAT_TEMPLATE


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def history(ids: tuple[str, str, str, str]) -> list[dict]:
    """Two tool turns: two parallel calls, then one; ``ids``: the client's ids (the last answers the third)."""
    a, b, c, answer_c = ids
    return [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [call(a, "get_weather", {"city": "Paris"}),
                                                            call(b, "get_time", {"tz": "CET"})]},
        {"role": "tool", "tool_call_id": b, "content": "12:00"},  # answers out of order
        {"role": "tool", "tool_call_id": a, "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "tool_calls": [call(c, "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": answer_c, "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ]


CANONICAL = ("functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2",
             "functions.get_weather:2")


@pytest.mark.parametrize(("ids", "want"), [
    (("call_a1", "call_b2", "call_c3", "call_c3"), CANONICAL),  # OpenAI-style
    (("toolu_01", "toolu_02", "toolu_01", "toolu_01"), CANONICAL),  # Anthropic-style, an id reused by a later turn
    (CANONICAL, CANONICAL),
    # Kimi's own ids (as the model emitted them, numbered its own way) round-trip unchanged; an id in Kimi's
    # form for another function, or already used, is rewritten after the highest IDX
    (("functions.get_weather:7", "x", "functions.get_time:0", "functions.get_time:0"),
     ("functions.get_weather:7", "functions.get_time:8", "functions.get_weather:9", "functions.get_weather:9")),
    (("functions.get_weather:0", "functions.get_time:1", "functions.get_weather:0", "functions.get_weather:0"),
     ("functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2", "functions.get_weather:2")),
])
def test_ids_rewritten_consistently(ids, want) -> None:
    sent = history(ids)
    assert kimi_tool_ids(sent) == history(want)
    assert sent == history(ids)  # the client's messages are not modified in place
    assert template_messages(history(ids), "hermes") == history(ids)  # other parsers: as sent


def test_unanswerable_ids_are_400() -> None:
    bad = history(("a", "b", "c", "zzz"))
    with pytest.raises(APIError) as e:
        kimi_tool_ids(bad)
    assert e.value.status == 400 and e.value.param == "messages"
    assert "messages[5].tool_call_id 'zzz' matches no tool call" in e.value.message and "'c'" in e.value.message
    stale = history(("a", "b", "c", "a"))  # an id of an earlier turn, not of the message before it
    with pytest.raises(APIError, match="messages\\[5\\].tool_call_id 'a'"):
        kimi_tool_ids(stale)
    twice = history(("a", "a", "c", "c"))
    with pytest.raises(APIError, match="messages\\[1\\].tool_calls\\[1\\].id 'a' repeats"):
        kimi_tool_ids(twice)


def test_rendered_on_the_kimi_standin_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_kimi_tokenizer(tmp_path, 512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    mixed = history(("call_a1", "toolu_02", "call_a1", "call_a1"))
    prompt = tok.apply_chat_template(kimi_tool_ids(mixed), chat_template=KIMI_TOOL_TEMPLATE, tokenize=False,
                                     add_generation_prompt=True)
    assert "call_a1" not in prompt and "toolu_02" not in prompt
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1') in prompt
    answers = [line for line in prompt.split("<|im_middle|>") if line.startswith("## Return of")]
    assert answers == ["## Return of functions.get_time:1\n12:00<|im_end|><|im_system|>tool",
                       "## Return of functions.get_weather:0\nsunny<|im_end|><|im_assistant|>assistant",
                       "## Return of functions.get_weather:2\nrain<|im_end|><|im_user|>user"]
    # the same tokens as a client that sent Kimi's own ids
    canonical = tok.apply_chat_template(history(CANONICAL), chat_template=KIMI_TOOL_TEMPLATE,
                                        add_generation_prompt=True, tokenize=False)
    assert tok.encode(prompt, add_special_tokens=False) == tok.encode(canonical, add_special_tokens=False)
