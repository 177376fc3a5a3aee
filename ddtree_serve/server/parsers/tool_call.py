"""Tool-call parsers, streaming: ``kimi_k2`` and ``hermes``.

kimi_k2 (FACTS.md)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|> ... <|tool_calls_section_end|>

The call id is the header ``functions.NAME:IDX`` (what Kimi's template expects back in ``tool_call_id``);
arguments stream as they are generated. hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
one call is emitted whole when its closing tag arrives (arguments are nested JSON).

``feed(delta) -> (content_delta, [ToolCallDelta])``; the first delta of a call carries its index, id and
name, later ones only argument text. Concatenating the streamed pieces gives the non-streaming result.

Two request rules (``tool_names``, ``max_calls``; both parsers, streaming and not):

- a call whose name is not among ``tool_names`` (the request's tools) is not a call: its text is content,
  kimi_k2 from its ``<|tool_call_begin|>`` to its ``<|tool_call_end|>`` (a bogus or malformed header such as
  ``functionsexec5``), hermes its whole ``<tool_call>...</tool_call>``;
- calls past ``max_calls`` (``parallel_tool_calls: false``: 1) are dropped, neither calls nor content.

Call indices count the calls returned only (0, 1, ... without gaps).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from ddtree_serve.server.parsers._text import find_first, partial_suffix_len

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
    """``tool_names``: the names a call may have (None: any); ``max_calls``: how many calls are kept (None: all)."""

    def __init__(self, kind: str, tool_names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        if kind not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {kind!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")
        self.kind = kind
        self._names = frozenset(tool_names) if tool_names is not None else None
        self._max_calls = max_calls
        self._buf = ""
        # kimi: text | section | header | args | raw (an unknown name's call, as text) | drop; hermes: text | call
        self._state = "text"
        self._index = 0

    def _verdict(self, name: str) -> str:
        """What a call named ``name`` becomes: ``args`` (a call), ``raw`` (text) or ``drop``."""
        if self._names is not None and name not in self._names:
            return "raw"
        if self._max_calls is not None and self._index >= self._max_calls:
            return "drop"
        return "args"

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
                raw_header = self._buf[:i]
                header = raw_header.strip()
                self._buf = self._buf[i + len(KIMI_ARG_BEGIN):]
                name = header.split(":", 1)[0] if ":" in header else header
                if name.startswith("functions."):
                    name = name[len("functions."):]
                self._state = self._verdict(name)
                if self._state == "raw":
                    text.append(KIMI_CALL_BEGIN + raw_header + KIMI_ARG_BEGIN)
                elif self._state == "args":
                    calls.append(ToolCallDelta(index=self._index, id=header or f"functions.{name}:{self._index}",
                                               name=name))
                continue
            # args | raw | drop: the call's body up to <|tool_call_end|>
            i, _ = find_first(self._buf, (KIMI_CALL_END,))
            end = i if i >= 0 else len(self._buf) - (0 if final else partial_suffix_len(self._buf, (KIMI_CALL_END,)))
            if end > 0 and self._state == "args":
                calls.append(ToolCallDelta(index=self._index, arguments=self._buf[:end]))
            elif end > 0 and self._state == "raw":
                text.append(self._buf[:end])
            if i >= 0:
                text.append(KIMI_CALL_END if self._state == "raw" else "")
                self._buf = self._buf[i + len(KIMI_CALL_END):]
            else:
                self._buf = self._buf[end:]
            if (i >= 0 or final) and self._state == "args":
                self._index += 1
            if i < 0:
                break
            self._state = "section"
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
            verdict = "raw" if call is None else self._verdict(call.name or "")
            if verdict == "raw":  # not a valid call, or not of a request's tool: keep it as text
                text.append(HERMES_BEGIN + body + (HERMES_END if i >= 0 else ""))
            elif verdict == "args":
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


def parse_tool_calls(kind: str, text: str, tool_names: Collection[str] | None = None,
                     max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """Whole-text form: ``(content without tool-call markup, calls)``; ``tool_names``, ``max_calls``: as
    ``ToolCallParser``'s."""
    parser = ToolCallParser(kind, tool_names, max_calls)
    t1, d1 = parser.feed(text)
    t2, d2 = parser.finish()
    return t1 + t2, merge_deltas(d1 + d2)
