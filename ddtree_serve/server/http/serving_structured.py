"""Structured output: the request fields that constrain generation, mapped to one grammar constraint
(``SamplingParams.json_schema`` / ``regex`` / ``ebnf``) that the engine enforces with token masks.

- ``response_format``: ``{"type": "text"}`` is no constraint; ``{"type": "json_object"}`` is the JSON
  Schema ``{"type": "object"}``; ``{"type": "json_schema", "json_schema": {"schema": S, ...}}`` is
  ``json.dumps(S)``.
- ``regex`` and ``ebnf`` (SGLang's request extensions) pass through.
- ``tool_choice`` "required" or ``{"type": "function", "function": {"name": N}}`` (chat only) is the EBNF of
  ddtree_serve/server/parsers/tool_grammar.py, in the format of the server's ``--tool-call-parser``.

At most one constraint per request (400 otherwise). A grammar the engine cannot compile is a 400 from the
engine at admission (ValueError at add_request).

Thinking models (``reasoning_gate``): with a ``--reasoning-parser`` and thinking on, the grammar applies
after the reasoning, as vLLM's reasoning-aware structured outputs do: the constraint carries the token ids
that end the reasoning (``</think>``; for ``kimi_k2`` also ``<|tool_calls_section_begin|>``, which the
reasoning parser hands on to the content), and the engine keeps the grammar dormant until one of them is
generated (``ddtree_serve.model_executor.grammar.state``). So the reasoning is free and the content (what the reasoning
parser returns after it) follows the grammar. Without a reasoning parser, or where ``</think>`` is not one
token of the tokenizer, the grammar holds from the first generated token (the reply is all content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest, CompletionRequest, ToolChoice
from ddtree_serve.server.parsers.reasoning import KIMI_TOOL_SECTION_BEGIN, THINK_END
from ddtree_serve.server.parsers.tool_grammar import ToolGrammarError, tool_call_ebnf

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format {"type": "json_object"}


@dataclass(frozen=True)
class Constraint:
    """One grammar constraint (at most one field set); ``forces_tools`` when it is a forced tool call."""

    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    forces_tools: bool = False
    reasoning_end_ids: tuple[int, ...] = ()  # the grammar starts after one of these (``reasoning_gate``)
    reasoning_handoff_ids: tuple[int, ...] = ()  # ... or with one of these

    @property
    def active(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def after_reasoning(self) -> bool:
        """The grammar waits for the end of the reasoning (the reply has a reasoning section)."""
        return self.active and bool(self.reasoning_end_ids)

    def fields(self) -> dict[str, Any]:
        """The SamplingParams fields."""
        return {"json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf,
                "reasoning_end_ids": self.reasoning_end_ids, "reasoning_handoff_ids": self.reasoning_handoff_ids}


NO_CONSTRAINT = Constraint()


def forced_tool_choice(req: ChatCompletionRequest) -> bool:
    """``tool_choice`` is "required" or names a function."""
    return req.tool_choice == "required" or isinstance(req.tool_choice, ToolChoice)


def constraint_of(req: ChatCompletionRequest | CompletionRequest, tool_parser: str | None = None) -> Constraint:
    """The request's grammar constraint. ``tool_parser``: the server's ``--tool-call-parser`` (chat only).
    Raises APIError 400 for conflicting constraints, a forced ``tool_choice`` without tools, without a tool
    parser, naming an unknown function, or whose tools' schemas cannot be turned into a grammar."""
    found: list[tuple[str, Constraint]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint(json_schema=JSON_OBJECT_SCHEMA)))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None and rf.json_schema.schema_ is not None  # checked by the model
        found.append(("response_format", Constraint(json_schema=json.dumps(rf.json_schema.schema_))))
    if req.regex is not None:
        found.append(("regex", Constraint(regex=req.regex)))
    if req.ebnf is not None:
        found.append(("ebnf", Constraint(ebnf=req.ebnf)))
    if isinstance(req, ChatCompletionRequest) and forced_tool_choice(req):
        found.append(("tool_choice", _tool_constraint(req, tool_parser)))
    # parallel_tool_calls: false with tool_choice auto keeps the first call (the tool-call parser's max_calls)
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"at most one output constraint per request, got {names}", param=found[1][0],
                       code="conflicting_constraints")
    return found[0][1] if found else NO_CONSTRAINT


def _tool_constraint(req: ChatCompletionRequest, tool_parser: str | None) -> Constraint:
    what = "'required'" if req.tool_choice == "required" else "a named function"
    if not req.tools:
        raise APIError(400, f"tool_choice {what} needs 'tools'", param="tool_choice", code="invalid_value")
    if tool_parser is None:
        raise APIError(400, f"tool_choice {what} needs a tool-call format: start the server with "
                            "--tool-call-parser (kimi_k2 or hermes)", param="tool_choice",
                       code="unsupported_value")
    named = req.tool_choice.function.name if isinstance(req.tool_choice, ToolChoice) else None
    tools: list[tuple[str, dict[str, Any] | None]] = [(t.function.name, t.function.parameters) for t in req.tools]
    try:
        ebnf = tool_call_ebnf(tool_parser, tools, named, parallel=req.parallel_tool_calls is not False)
    except ToolGrammarError as e:
        raise APIError(400, str(e), param="tool_choice" if e.index < 0 else "tools", code="invalid_value") from None
    return Constraint(ebnf=ebnf, forces_tools=True)


def reasoning_gate(constraint: Constraint, tokenizer: Any, reasoning_parser: str | None, thinking: bool) -> Constraint:
    """``constraint`` applied after the reasoning when the reply has one: a reasoning parser, thinking on, and
    ``</think>`` one token of ``tokenizer``. Otherwise ``constraint`` as it is (the grammar holds from the
    first generated token)."""
    if not (constraint.active and reasoning_parser and thinking):
        return constraint
    end = _single_token(tokenizer, THINK_END)
    if end is None:
        return constraint
    handoff = _single_token(tokenizer, KIMI_TOOL_SECTION_BEGIN) if reasoning_parser == "kimi_k2" else None
    return replace(constraint, reasoning_end_ids=(end,), reasoning_handoff_ids=() if handoff is None else (handoff,))


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as one token, else None."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return int(ids[0]) if len(ids) == 1 else None
