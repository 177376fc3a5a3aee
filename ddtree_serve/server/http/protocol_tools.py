"""OpenAI request models for tools and structured output: tool definitions, ``tool_choice``, the tool calls
of earlier assistant turns, and ``response_format``.

How these fields become grammar constraints (``SamplingParams.json_schema`` / ``regex`` / ``ebnf``) is in
ddtree_serve/server/http/serving_structured.py; the grammar of a forced tool call in ddtree_serve/server/parsers/tool_grammar.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# strict types; unknown extra fields are ignored (OpenAI clients send several this server does not use)
REQUEST_CONFIG = ConfigDict(strict=True, extra="ignore")
_REQ = REQUEST_CONFIG


def _integral(v: Any) -> Any:
    """A float with no fractional part is that integer: JSON (and JSON Schema's ``integer``) does not tell 2.0
    from 2, so neither does the server; anything else is left to the strict int check."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# the request models' integers: strict, but 2.0 is 2. Bounds go before INTEGRAL (``Annotated[int, Field(ge=0),
# INTEGRAL]``), so that they stay in the published JSON Schema (after it, pydantic checks them but drops them)
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]


TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's (and Anthropic's) rule for a function's name


class FunctionDef(BaseModel):
    model_config = _REQ
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _REQ
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(BaseModel):
    model_config = _REQ
    name: str


class ToolChoice(BaseModel):
    """A named ``tool_choice``: ``{"type": "function", "function": {"name": ...}}`` forces one call of it."""

    model_config = _REQ
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCallMsg(BaseModel):
    model_config = _REQ
    name: str
    arguments: str


class ToolCallMsg(BaseModel):
    model_config = _REQ
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMsg


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. ``schema`` is required here (OpenAI lists it as optional, but without
    it there is nothing to constrain to; ``{"type": "json_object"}`` asks for any JSON object). ``strict`` is
    accepted and changes nothing: the output always follows the schema (grammar-constrained decoding)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True, json_schema_extra={"allOf": [  # _has_schema
        {"required": ["schema"], "properties": {"schema": {"type": "object"}}}]})
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _has_schema(self) -> JsonSchemaFormat:
        if self.schema_ is None:
            raise ValueError("'schema' is required (a JSON Schema object); use {'type': 'json_object'} for any "
                             "JSON object")
        return self


class ResponseFormat(BaseModel):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [  # _schema_iff_json_schema
        {"if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
         "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
         "else": {"properties": {"json_schema": {"type": "null"}}}}]})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is only allowed when type is 'json_schema' (type is {self.type!r})")
        return self
