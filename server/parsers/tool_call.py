"""Tool-call parsers, streaming: ``kimi_k2`` and ``hermes``.

kimi_k2 (FACTS.md)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|> ... <|tool_calls_section_end|>

The call id is the header ``functions.NAME:IDX`` (what Kimi's template expects back in ``tool_call_id``);
arguments stream as they are generated. hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
one call is emitted whole when its closing tag arrives (arguments are nested JSON).

``feed(delta) -> (content_delta, [ToolCallDelta])``; the first delta of a call carries its index, id and
name, later ones only argument text. Concatenating the streamed pieces gives the non-streaming result.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from server.parsers._text import find_first, partial_suffix_len

TOOL_CALL_PARSERS: tuple[str, ...] = ("kimi_k2", "hermes")

KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARG_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
HERMES_BEGIN = "<tool_call>"
HERMES_END = "</tool_call>"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


class ToolCallParser:
    def __init__(self, kind: str) -> None:
        if kind not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {kind!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")
        self.kind = kind
        self._buf = ""
        self._state = "text"  # kimi: text | section | header | args; hermes: text | call
        self._index = 0

    @property
    def num_calls(self) -> int:
        return self._index

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += delta
        if self.kind == "kimi_k2":
            return self._feed_kimi(final=False)
        return self._feed_hermes(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.kind == "kimi_k2":
            return self._feed_kimi(final=True)
        return self._feed_hermes(final=True)

    # ---- kimi_k2 -------------------------------------------------------------------------------------
    def _feed_kimi(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        text, calls = [], []
        while True:
            if self._state == "text":
                i, _ = find_first(self._buf, (KIMI_SECTION_BEGIN,))
                if i >= 0:
                    text.append(self._buf[:i])
                    self._buf = self._buf[i + len(KIMI_SECTION_BEGIN):]
                    self._state = "section"
                    continue
                hold = 0 if final else partial_suffix_len(self._buf, (KIMI_SECTION_BEGIN,))
                cut = len(self._buf) - hold
                text.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            if self._state == "section":
                i, marker = find_first(self._buf, (KIMI_CALL_BEGIN, KIMI_SECTION_END))
                if marker is None:
                    if final:
                        self._buf = ""
                    break
                self._buf = self._buf[i + len(marker):]
                self._state = "header" if marker == KIMI_CALL_BEGIN else "text"
                continue
            if self._state == "header":
                i, _ = find_first(self._buf, (KIMI_ARG_BEGIN,))
                if i < 0:
                    if final:  # a header cut short (max_tokens): not a call, its text stays content
                        text.append(KIMI_CALL_BEGIN + self._buf)
                        self._buf = ""
                    break
                header = self._buf[:i].strip()
                self._buf = self._buf[i + len(KIMI_ARG_BEGIN):]
                name = header.split(":", 1)[0] if ":" in header else header
                if name.startswith("functions."):
                    name = name[len("functions."):]
                calls.append(ToolCallDelta(index=self._index, id=header or f"functions.{name}:{self._index}",
                                           name=name))
                self._state = "args"
                continue
            # args
            i, _ = find_first(self._buf, (KIMI_CALL_END,))
            if i >= 0:
                if i > 0:
                    calls.append(ToolCallDelta(index=self._index, arguments=self._buf[:i]))
                self._buf = self._buf[i + len(KIMI_CALL_END):]
                self._index += 1
                self._state = "section"
                continue
            hold = 0 if final else partial_suffix_len(self._buf, (KIMI_CALL_END,))
            cut = len(self._buf) - hold
            if cut > 0:
                calls.append(ToolCallDelta(index=self._index, arguments=self._buf[:cut]))
            self._buf = self._buf[cut:]
            if final:
                self._index += 1
            break
        return "".join(text), calls

    # ---- hermes --------------------------------------------------------------------------------------
    def _feed_hermes(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        text, calls = [], []
        while True:
            if self._state == "text":
                i, _ = find_first(self._buf, (HERMES_BEGIN,))
                if i >= 0:
                    text.append(self._buf[:i])
                    self._buf = self._buf[i + len(HERMES_BEGIN):]
                    self._state = "call"
                    continue
                hold = 0 if final else partial_suffix_len(self._buf, (HERMES_BEGIN,))
                cut = len(self._buf) - hold
                text.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            i, _ = find_first(self._buf, (HERMES_END,))
            if i < 0 and not final:
                break
            body = self._buf[:i] if i >= 0 else self._buf
            rest = self._buf[i + len(HERMES_END):] if i >= 0 else ""
            call = self._hermes_call(body)
            if call is None:  # not a valid call: keep it as text
                text.append(HERMES_BEGIN + body + (HERMES_END if i >= 0 else ""))
            else:
                calls.append(call)
                self._index += 1
            self._buf = rest
            self._state = "text"
            if i < 0:
                break
        return "".join(text), calls

    def _hermes_call(self, body: str) -> ToolCallDelta | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCallDelta(index=self._index, id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"],
                             arguments=args_text)


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Fold streamed deltas into whole calls, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ToolCall(id="", name="", arguments=""))
        if d.id:
            call.id = d.id
        if d.name:
            call.name = d.name
        call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_tool_calls(kind: str, text: str) -> tuple[str, list[ToolCall]]:
    """Whole-text form: ``(content without tool-call markup, calls)``."""
    parser = ToolCallParser(kind)
    t1, d1 = parser.feed(text)
    t2, d2 = parser.finish()
    return t1 + t2, merge_deltas(d1 + d2)
