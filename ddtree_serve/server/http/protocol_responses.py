"""OpenAI Responses API request models (POST /v1/responses, stateless).

Strict like the chat models (ddtree_serve/server/http/protocol.py): wrong types and out-of-range values are a 400 naming the
field, in OpenAI's error shape. Unknown extra fields are ignored; the known fields this server cannot honour
are declared here and refused by the handler (ddtree_serve/server/http/serving_responses.py ``REFUSED``), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from ddtree_serve.server.http.protocol_rules import (
    CHAT_TOOL_RULES,
    FORCED_TOOL,
    has,
    if_then,
    needs,
    only_null,
)
from ddtree_serve.server.http.protocol_tools import INTEGRAL, TOOL_NAME_PATTERN
from ddtree_serve.server.http.protocol_tools import REQUEST_CONFIG as _REQ


class TextContent(BaseModel):
    """A text part of a message item (``input_text`` in inputs, ``output_text`` in earlier replies)."""

    model_config = _REQ
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImageContent(BaseModel):
    """An image part of a user message (``input_image``): a ``data:`` URL or an allowed http(s) URL, served as
    chat's ``image_url`` part
    (models with a vision tower; docs/API.md, Images). ``file_id`` (uploaded files) is refused: no file store."""

    model_config = _REQ
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's own resize rule applies
    file_id: Any = Field(None, json_schema_extra=only_null("no file store: send the image as a data: URL"))

    @field_validator("file_id", mode="before")
    @classmethod
    def _no_file_id(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("file_id is not supported: this server keeps no files; send image_url as a data: URL")
        return v


class MessageItem(BaseModel):
    model_config = _REQ
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextContent | ImageContent, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextContent))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: text parts, and image parts as ``image_url`` parts."""
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": p.text} if isinstance(p, TextContent)
                else {"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}}
                for p in self.content]


class FunctionCallItem(BaseModel):
    """An earlier call; ``namespace``: the call of a namespace tool's function (served flattened,
    ddtree_serve/server/http/responses_tools.py)."""

    model_config = _REQ
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _REQ
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(BaseModel):
    model_config = _REQ
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning: its text becomes the next assistant message's ``reasoning_content``;
    ``encrypted_content`` (sealed by this server: ddtree_serve/server/http/reasoning_seal.py) holds it whole and
    is opened by the handler."""

    model_config = _REQ
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(union_mode="left_to_right")]


class FunctionTool(BaseModel):
    """A function tool."""

    model_config = _REQ
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(BaseModel):
    """Codex's group of function tools (an MCP server's, ...): served flattened, ``NAME__FUNCTION``."""

    model_config = _REQ
    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    tools: list[FunctionTool]


class OtherTool(BaseModel):
    """A tool of another type (a built-in tool such as ``web_search``, ``file_search``; a freeform ``custom``
    tool): accepted and not offered to the model (ddtree_serve/server/http/responses_tools.py)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str = Field(json_schema_extra={"not": {"enum": ["function", "namespace"]}})  # the spec's oneOf: one match


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("function", "namespace") else "other"


ResponsesTool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[NamespaceTool, Tag("namespace")]
                          | Annotated[OtherTool, Tag("other")], Discriminator(_tool_kind)]


class NamedFunction(BaseModel):
    model_config = _REQ
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "name", "schema", "strict"?, "description"?}``."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True, json_schema_extra={"allOf": [
        if_then(has("type", {"const": "json_schema"}), needs("name", "schema"))]})
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=TOOL_NAME_PATTERN)  # as chat's response_format.json_schema.name
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type 'json_schema' needs 'name' and 'schema'")
        return self


class TextConfig(BaseModel):
    model_config = _REQ
    format: TextFormat | None = None
    verbosity: Any = Field(None, json_schema_extra=only_null("no verbosity levels"))  # refused


# a conversation: instructions, or an input with more than reasoning items (reasoning alone makes no message)
_SOME_MESSAGE = {"anyOf": [needs("instructions"), {"properties": {"input": {"anyOf": [
    {"type": "string"}, {"type": "array", "contains": {"not": has("type", {"const": "reasoning"})}}]}}}]}
_JSON_TEXT = has("text", {"type": "object", "required": ["format"], "properties": {"format": {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}})


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` is applied through the model's thinking switch (as chat's
    ``reasoning_effort``: ddtree_serve/server/http/thinking.py); with a ``summary`` the reasoning item's summary
    holds the whole reasoning (it is never shortened)."""

    model_config = _REQ
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of summary


class ResponsesRequest(BaseModel):
    """POST /v1/responses. ``store`` may be omitted or false; nothing is stored. The refused fields are
    published as null only; the chat rules of tools hold (a forced ``tool_choice`` needs ``tools`` and excludes
    a JSON ``text.format``)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [
        *CHAT_TOOL_RULES, {"not": {"allOf": [_JSON_TEXT, FORCED_TOOL]}}, _SOME_MESSAGE]})
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = Field(None, json_schema_extra={"anyOf": [{"const": False}, {"type": "null"}]})
    include: list[Literal["reasoning.encrypted_content"]] | None = None  # the one optional output produced
    truncation: Literal["auto", "disabled"] | None = Field(None, json_schema_extra={"enum": ["disabled", None]})
    reasoning: ReasoningConfig | None = None
    # known, refused (ddtree_serve/server/http/serving_responses.py REFUSED)
    previous_response_id: Any = Field(None, json_schema_extra=only_null("no stored responses"))
    conversation: Any = Field(None, json_schema_extra=only_null("no stored conversations"))
    background: Any = Field(None, json_schema_extra=only_null("foreground only"))
    top_logprobs: Any = Field(None, json_schema_extra=only_null("use /v1/chat/completions"))
    max_tool_calls: Any = Field(None, json_schema_extra=only_null("not enforced"))
    prompt: Any = Field(None, json_schema_extra=only_null("no stored prompt templates"))
    service_tier: Any = Field(None, json_schema_extra=only_null("one tier is served"))
    stream_options: Any = Field(None, json_schema_extra=only_null("not on /v1/responses"))

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v
