"""Streaming output parsers: reasoning (``<think>...</think>``) and tool calls (Kimi K2, Hermes).

Both parsers have the same shape: ``feed(delta) -> result`` while text streams in, ``finish() -> result``
at the end. Feeding a text in any split gives the same concatenated result as feeding it whole.
"""

from ddtree_serve.server.parsers.reasoning import REASONING_PARSERS, ReasoningParser, parse_reasoning
from ddtree_serve.server.parsers.tool_call import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    parse_tool_calls,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "parse_reasoning",
    "parse_tool_calls",
]
