"""Tools the model can see: a chat template that renders no tools gets them written into the system turn.

With a ``--tool-call-parser`` the server parses calls from the reply, but a chat template without a place
for tools (it never reads the ``tools`` variable: SmolLM2's, many base-model templates) drops the request's
tool list, and an agent's tools never reach the model. Then the server writes the list into the system turn
(appended to the first system message, or a system message of its own first) in the format its parser reads,
and the history's calls and results as text in that format too (such a template renders no ``tool_calls``):

- ``hermes``: a ``# Tools`` section with one JSON object per tool inside ``<tools></tools>`` and the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention (Hermes / Qwen2.5's wording); past
  calls as ``<tool_call>`` blocks after the assistant's text, results as ``<tool_response>`` blocks;
- ``kimi_k2``: the tools as JSON and Kimi's call syntax (``<|tool_calls_section_begin|>``,
  ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``,
  ``<|tool_calls_section_end|>``); results as ``## Return of ID``.

Whether the template reads ``tools`` is decided once per server (``template_reads_tools``, at start-up).
"""

from __future__ import annotations

import json
from typing import Any

HERMES_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
HERMES_CALLS = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
KIMI_INTRO = "# Tools\n\nYou may call the functions declared below (JSON):\n"
KIMI_CALLS = ("\n\nTo call functions, write <|tool_calls_section_begin|>, then for each call "
              "<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|> "
              "(IDX counts the conversation's calls from 0), then <|tool_calls_section_end|>.")


def template_reads_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Whether ``chat_template`` (Jinja text, or named templates: its ``default`` one) reads ``tools``; an
    unparsable or missing template counts as reading it (nothing is written then)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    if not chat_template:
        return True
    import jinja2
    import jinja2.meta

    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return True
    return "tools" in names


def tools_text(tools: list[dict[str, Any]], parser: str) -> str:
    """The tool list and the call convention of ``parser``, as system-turn text."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser == "kimi_k2":
        return KIMI_INTRO + listed + KIMI_CALLS
    return HERMES_INTRO + listed + HERMES_CALLS


def _call_text(call: dict[str, Any], parser: str) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    if parser == "kimi_k2":
        return f"<|tool_call_begin|>{call.get('id')}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": parsed}, ensure_ascii=False) + \
        "\n</tool_call>"


def _joined(text: Any, extra: str) -> str:
    text = text if isinstance(text, str) else ""
    return f"{text}\n\n{extra}" if text else extra


def tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: str
                    ) -> list[dict[str, Any]]:
    """``messages`` (as the template takes them: string contents) with ``tools`` written into the system turn
    and the history's calls and results as text, in ``parser``'s format."""
    out = [dict(m) for m in messages]
    block = tools_text(tools, parser)
    if out and out[0].get("role") == "system":
        out[0]["content"] = _joined(out[0].get("content"), block)
    else:
        out.insert(0, {"role": "system", "content": block})
    for m in out:
        calls = m.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            text = "".join(_call_text(c, parser) for c in calls)
            if parser == "kimi_k2":
                text = f"<|tool_calls_section_begin|>{text}<|tool_calls_section_end|>"
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") and parser != "kimi_k2" else "") + text
        elif m.get("role") == "tool":
            body = m.get("content") or ""
            m["content"] = (f"## Return of {m.get('tool_call_id')}\n{body}" if parser == "kimi_k2"
                            else f"<tool_response>\n{body}\n</tool_response>")
    return out
