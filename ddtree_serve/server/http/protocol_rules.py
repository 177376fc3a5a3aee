"""JSON Schema fragments that publish the request models' cross-field rules in the OpenAPI spec.

Validation enforces these rules in the models' validators (ddtree_serve/server/http/protocol*.py) or the handlers
(ddtree_serve/server/http/serving_*.py); the fragments below say the same in JSON Schema (``if``/``then``, ``not``,
``anyOf``), so a client generated from /openapi.json sends bodies the server accepts. Each model adds them to
its schema through ``json_schema_extra={"allOf": [...]}``.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

Schema = dict[str, Any]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range (OpenAI's: an int64)
# the published range of an int64 field: the integers JSON numbers hold exactly (tools that compare bounds as
# doubles would otherwise take 2**63 for INT64_MAX)
JSON_SAFE_INT = {"minimum": -(2**53 - 1), "maximum": 2**53 - 1}


def needs(*fields: str) -> Schema:
    """``fields`` present and not null."""
    return {"required": list(fields), "properties": {f: {"not": {"type": "null"}} for f in fields}}


def has(field: str, schema: Schema) -> Schema:
    """``field`` present, with a value matching ``schema``."""
    return {"required": [field], "properties": {field: schema}}


def at_most_one(*sets: Schema) -> list[Schema]:
    """No two of ``sets`` (each a ``has``) hold at once."""
    return [{"not": {"allOf": [a, b]}} for a, b in combinations(sets, 2)]


def if_then(condition: Schema, then: Schema) -> Schema:
    return {"if": condition, "then": then}


def only_null(description: str) -> Schema:
    """The schema of a known field the server refuses whenever it is set (an explicit ``null`` is accepted)."""
    return {"type": "null", "description": f"not supported: {description}"}


# the structured-output fields: at most one constraint per request (ddtree_serve/server/http/serving_structured.py)
JSON_FORMAT = has("response_format", {"type": "object", "required": ["type"],
                                      "properties": {"type": {"enum": ["json_object", "json_schema"]}}})
REGEX = has("regex", {"type": "string"})
EBNF = has("ebnf", {"type": "string"})
FORCED_TOOL = has("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]})
SOME_TOOLS = has("tools", {"type": "array", "minItems": 1})

# chat: one constraint; a forced tool_choice needs tools (parallel_tool_calls false goes with any tool_choice:
# with auto the first call is kept)
CHAT_TOOL_RULES = [*at_most_one(JSON_FORMAT, REGEX, EBNF, FORCED_TOOL), if_then(FORCED_TOOL, SOME_TOOLS)]

# stream_options only with stream: true (both endpoints)
STREAM_OPTIONS_RULE = if_then(needs("stream_options"), has("stream", {"const": True}))
# chat: continue_final_message only with add_generation_prompt false (its last message must be an assistant's:
# the last item of a list, which JSON Schema cannot single out; docs/API.md)
CONTINUE_RULE = if_then(has("continue_final_message", {"const": True}), has("add_generation_prompt", {"const": False}))
