"""The grammar of a forced tool call (``tool_choice`` "required" or a named function), as EBNF text for
``SamplingParams.ebnf``, in the call format of the active tool-call parser (ddtree_serve/server/parsers/tool_call.py).

Each tool's ``parameters`` JSON Schema becomes grammar rules through xgrammar's converter
(``Grammar.from_json_schema``, the one SGLang and vLLM use), compact (no free whitespace, so a model cannot
pad the arguments forever) and strict (no properties beyond the schema's). Every tool's rules get a
prefix (``t3_root``, ``t3_basic_string`` ...) so that several tools live in one grammar, and a root rule
composes the calls (``ARGS_i`` is tool i's schema)::

    kimi_k2:  root ::= "<|tool_calls_section_begin|>" tool_call+ "<|tool_calls_section_end|>"
              call_i ::= "<|tool_call_begin|>functions.NAME_i:" [0-9]+ "<|tool_call_argument_begin|>"
                         ARGS_i "<|tool_call_end|>"
    hermes:   root ::= tool_call+
              call_i ::= "<tool_call>\\n{\\"name\\": \\"NAME_i\\", \\"arguments\\": " ARGS_i "}\\n</tool_call>"

``tool_call`` is the alternation of every tool's ``call_i`` ("required": one or more calls of any tool);
for a named tool the root holds exactly one call of that tool. The grammar starts at the first generated
token: the reply is the calls and nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from ddtree_serve.server.parsers.tool_call import (
    HERMES_BEGIN,
    HERMES_END,
    KIMI_ARG_BEGIN,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_SECTION_BEGIN,
    KIMI_SECTION_END,
    TOOL_CALL_PARSERS,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # ``parameters`` omitted: {} only
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[05:41:18] /project/cpp/x.cc:4944: "
_RULE_DEF = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::=", re.MULTILINE)


class ToolGrammarError(ValueError):
    """A tool that cannot be forced: ``index`` is its position in ``tools``."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def literal(text: str) -> str:
    """``text`` as an EBNF string literal (xgrammar reads JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def prefix_rules(ebnf: str, prefix: str) -> str:
    """Rename every rule of ``ebnf`` (definitions and references) to ``prefix + name``. Only the names that
    ``ebnf`` defines are renamed (not macros such as ``Regex(..., json_string=true)`` or their arguments), and
    only outside string literals and character classes, which are copied as they are (escapes included)."""
    defined = set(_RULE_DEF.findall(ebnf))
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            m = _IDENT.match(ebnf, i)
            assert m is not None
            out.append(prefix + m.group() if m.group() in defined else m.group())
            i = m.end()
        elif c.isdigit():  # a count such as {1, -1}: digits never start a rule name
            j = i
            while j < n and ebnf[j].isdigit():
                j += 1
            out.append(ebnf[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def arguments_ebnf(parameters: dict[str, Any] | None, prefix: str) -> str:
    """Rules whose ``{prefix}root`` matches the JSON arguments ``parameters`` (a JSON Schema) allows."""
    import xgrammar

    schema = json.dumps(NO_PARAMETERS if parameters is None else parameters)
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return prefix_rules(str(grammar), prefix)


def _call_rule(parser: str, i: int, name: str) -> str:
    args = f"t{i}_root"
    if parser == "kimi_k2":
        return (f"call_{i} ::= {literal(KIMI_CALL_BEGIN + 'functions.' + name + ':')} [0-9]+ "
                f"{literal(KIMI_ARG_BEGIN)} {args} {literal(KIMI_CALL_END)}")
    head = HERMES_BEGIN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
    return f"call_{i} ::= {literal(head)} {args} {literal('}' + chr(10) + HERMES_END)}"


def tool_call_ebnf(parser: str, tools: Sequence[tuple[str, dict[str, Any] | None]], named: str | None = None,
                   parallel: bool = True) -> str:
    """EBNF forcing tool calls in ``parser``'s format. ``tools``: (name, parameters JSON Schema or None) in
    request order. ``named`` None: one or more calls of any tool ("required"; exactly one when ``parallel``
    is False); a name: exactly one call of that tool. Raises ToolGrammarError for a bad name, an unknown ``named`` (index -1) or a schema that
    cannot be converted, and ValueError for an unknown parser."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")
    if not tools:
        raise ToolGrammarError("no tools to call", -1)
    for i, (name, _) in enumerate(tools):
        if not TOOL_NAME.fullmatch(name):
            raise ToolGrammarError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}} to be forced, "
                                   f"got {name!r}", i)
    chosen = list(range(len(tools)))
    if named is not None:
        chosen = [i for i, (name, _) in enumerate(tools) if name == named][:1]
        if not chosen:
            raise ToolGrammarError(f"tool_choice names the function {named!r}, which is not in 'tools' "
                                   f"({', '.join(n for n, _ in tools)})", -1)
    rules: list[str] = []
    for i in chosen:
        name, parameters = tools[i]
        try:
            rules.append(arguments_ebnf(parameters, f"t{i}_"))
        except Exception as e:  # noqa: BLE001 - xgrammar raises several kinds for a schema it cannot convert
            detail = _XGRAMMAR_LOCATION.sub("", str(e).strip())
            raise ToolGrammarError(f"tools[{i}].function.parameters: cannot build a grammar from this JSON "
                                   f"Schema: {detail}", i) from None
        rules.append(_call_rule(parser, i, name))
    calls = ("tool_call+" if parallel else "tool_call") if named is None else f"call_{chosen[0]}"
    if named is None:
        rules.append("tool_call ::= " + " | ".join(f"call_{i}" for i in chosen))
    if parser == "kimi_k2":
        root = f"root ::= {literal(KIMI_SECTION_BEGIN)} {calls} {literal(KIMI_SECTION_END)}"
    else:
        root = f"root ::= {calls}"
    return "\n".join([root, *rules]) + "\n"
