"""Reasoning parser: separates ``<think>...</think>`` reasoning from the answer, streaming.

Both supported styles start generation inside the reasoning (the chat template opens it, or the model
writes ``<think>`` first, which is stripped). ``kimi_k2`` also ends the reasoning implicitly when the
model opens a tool-call section inside it: the section then belongs to the content, where the tool-call
parser finds it. With ``thinking=False`` (chat_template_kwargs ``{"thinking": false}``) all text is content.
"""

from __future__ import annotations

from ddtree_serve.server.parsers._text import find_first, partial_suffix_len

REASONING_PARSERS: tuple[str, ...] = ("kimi_k2", "deepseek-r1")

THINK_START = "<think>"
THINK_END = "</think>"
KIMI_TOOL_SECTION_BEGIN = "<|tool_calls_section_begin|>"


class ReasoningParser:
    """``feed(delta) -> (reasoning_delta, content_delta)``; ``finish()`` flushes what was held back."""

    def __init__(self, kind: str, *, thinking: bool = True) -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; choose from {', '.join(REASONING_PARSERS)}")
        self.kind = kind
        # End markers: "</think>" is consumed; a tool-section start is handed on to the content.
        self._end_markers: tuple[str, ...] = (THINK_END,)
        if kind == "kimi_k2":
            self._end_markers += (KIMI_TOOL_SECTION_BEGIN,)
        self._done = not thinking
        self._at_start = True
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if self._done:
            return "", delta
        self._buf += delta
        if self._at_start:
            stripped = self._buf.lstrip()
            if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                return "", ""  # still could be the opening tag
            if stripped.startswith(THINK_START):
                self._buf = stripped[len(THINK_START):]
            self._at_start = False
        i, marker = find_first(self._buf, self._end_markers)
        if marker is not None:
            reasoning = self._buf[:i]
            content = self._buf[i + len(THINK_END):] if marker == THINK_END else self._buf[i:]
            self._buf = ""
            self._done = True
            return reasoning, content
        hold = partial_suffix_len(self._buf, self._end_markers)
        cut = len(self._buf) - hold
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        if self._done:
            return "", ""
        self._done = True
        rest, self._buf = self._buf, ""
        if self._at_start and rest.strip() == "":
            return "", ""
        return rest, ""


def parse_reasoning(kind: str, text: str, *, thinking: bool = True) -> tuple[str, str]:
    """Whole-text form: ``(reasoning, content)``."""
    parser = ReasoningParser(kind, thinking=thinking)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
