"""Anthropic Messages API request models (POST /v1/messages) and their error shape.

Validation is as strict as the OpenAI models (ddtree_serve/server/http/protocol.py): a wrong type or an out-of-range value is a
400, here in Anthropic's error shape ``{"type": "error", "error": {"type", "message"}}``. Unknown extra fields
are ignored; the known fields this server cannot honour are declared here and refused by the handler
(ddtree_serve/server/http/serving_messages.py ``REFUSED``), never silently ignored. ``cache_control`` (top level, on a block
or a tool) is accepted: prefix caching is automatic here (every prompt prefix is cached), which is what it
asks for. ``temperature``/``top_p``/``top_k`` are not in newer Anthropic SDKs' signatures (send them in
``extra_body``); they are served as the Messages API defines them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddtree_serve.server.http.protocol_rules import has, if_then, needs, only_null
from ddtree_serve.server.http.protocol_tools import INTEGRAL, TOOL_NAME_PATTERN, Int
from ddtree_serve.server.http.protocol_tools import REQUEST_CONFIG as _REQ


class TextBlock(BaseModel):
    model_config = _REQ
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class Base64ImageSource(BaseModel):
    model_config = _REQ
    type: Literal["base64"]
    media_type: str
    data: str


class URLImageSource(BaseModel):
    model_config = _REQ
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    """An image (models with a vision tower; a 400 otherwise), in 'user' messages. A base64 source becomes a
    data: URL; a url source is passed on as it is (fetched from hosts --allowed-media-domains lists, else refused)."""

    model_config = _REQ
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: dict[str, Any] | None = None

    def url(self) -> str:
        s = self.source
        return f"data:{s.media_type};base64,{s.data}" if isinstance(s, Base64ImageSource) else s.url


class ToolUseBlock(BaseModel):
    model_config = _REQ
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = _REQ
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class PlainTextSource(BaseModel):
    model_config = _REQ
    type: Literal["text"]
    media_type: Literal["text/plain"] = "text/plain"
    data: str


class ContentSource(BaseModel):
    model_config = _REQ
    type: Literal["content"]
    content: str | list[TextBlock]


class DocumentCitations(BaseModel):
    model_config = _REQ
    enabled: Literal[False] = False  # citations are not produced: true is a 400


class DocumentBlock(BaseModel):
    """A document in a user message: plain text (``text`` source) or text blocks (``content`` source), given
    to the model as text (title, context, then the document). PDF (``base64``) and ``url`` sources are a 400:
    this server does not read PDFs or fetch URLs. ``citations`` are not produced: enabling them is a 400."""

    model_config = _REQ
    type: Literal["document"]
    source: Annotated[PlainTextSource | ContentSource, Field(discriminator="type")]
    title: str | None = None
    context: str | None = None
    citations: DocumentCitations | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        s = self.source
        body = s.data if isinstance(s, PlainTextSource) else (
            s.content if isinstance(s.content, str) else "".join(b.text for b in s.content))
        return "\n\n".join(x for x in (self.title, self.context, body) if x)


class ThinkingBlock(BaseModel):
    model_config = _REQ
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking")
ContentBlock = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


def _blocks_not(*kinds: str) -> dict:
    """Content (a string, or blocks) without blocks of ``kinds``."""
    return {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "not": {"properties": {"type": {"enum": list(kinds)}}, "required": ["type"]}}}]}}}


class InputMessage(BaseModel):
    """``_blocks_of_role``, published: tool_use and thinking blocks only in assistant messages, tool_result,
    image and document blocks only in user messages, text only in system messages (Claude Code sends
    ``system``-role messages inside ``messages``; the handler merges their text into the system prompt)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [
        if_then(has("role", {"const": "user"}), _blocks_not("tool_use", "thinking")),
        if_then(has("role", {"const": "assistant"}), _blocks_not("tool_result", "image", "document")),
        if_then(has("role", {"const": "system"}), _blocks_not(*(t for t in BLOCK_TYPES if t != "text")))]})
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """A clear 400 for the block types this server does not take (server tool blocks) and for documents it
        cannot read (PDF, URL and file sources)."""
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            src = block.get("source") if kind == "document" else None
            if isinstance(src, dict) and src.get("type") in ("base64", "url", "file"):
                raise ValueError(f"document source {src['type']!r} is not supported: this server reads plain-text "
                                 "documents (source type 'text' or 'content'); send a PDF's text instead")
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(f"content block type {kind!r} is not supported; send one of "
                                 f"{', '.join(BLOCK_TYPES)}")
        return data

    @model_validator(mode="after")
    def _blocks_of_role(self) -> InputMessage:
        """tool_use and thinking blocks are the assistant's; tool_result blocks the user's; a system message
        holds text."""
        for block in self.content if isinstance(self.content, list) else []:
            if self.role == "system" and block.type != "text":
                raise ValueError(f"a 'system' message holds text blocks only, not {block.type!r}")
            if block.type in ("tool_use", "thinking") and self.role != "assistant":
                raise ValueError(f"a {block.type!r} block belongs in an 'assistant' message")
            if block.type in ("tool_result", "image", "document") and self.role != "user":
                raise ValueError(f"a {block.type!r} block belongs in a 'user' message")
        return self


class AnthropicTool(BaseModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have no ``input_schema``
    and are refused by validation."""

    model_config = _REQ
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [  # _name_iff_tool
        {"if": has("type", {"const": "tool"}), "then": needs("name"),
         "else": {"properties": {"name": {"type": "null"}}}}]})
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool', and allowed only with it")
        return self


class ThinkingConfig(BaseModel):
    """Parsed in all of Anthropic's forms; served (and so published) are ``disabled``, ``adaptive`` and
    ``enabled`` (ddtree_serve/server/http/serving_messages.py: the model's thinking switch where a reasoning
    parser exists, accepted without thinking blocks where the model cannot think; ``budget_tokens`` does not
    bound the reasoning), with the reasoning displayed."""

    model_config = _REQ
    type: Literal["enabled", "disabled", "adaptive", "between_tools"] = Field(
        json_schema_extra={"enum": ["disabled", "adaptive", "enabled"]})
    budget_tokens: Int | None = None
    display: Literal["summarized", "omitted"] | None = Field(None, json_schema_extra={"enum": ["summarized", None]})


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``format``: the reply is JSON following the schema (grammar-constrained); ``effort``: the reasoning
    effort, mapped to the model's thinking switch where it has one (ddtree_serve/server/http/serving_messages.py)."""

    model_config = _REQ
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class Metadata(BaseModel):
    model_config = _REQ
    user_id: str | None = None


_FORCED = has("tool_choice", {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}})
_SOME_TOOLS = has("tools", {"type": "array", "minItems": 1})
_JSON_OUTPUT = has("output_config", {"type": "object", "required": ["format"],
                                     "properties": {"format": {"type": "object"}}})


class MessagesRequest(BaseModel):
    """POST /v1/messages. ``model`` may be omitted (the served model); a different name is a 404. Published
    with the rules of the chat request it becomes: a forced ``tool_choice`` (any, tool) needs ``tools`` and
    excludes ``output_config.format``. Not in the
    spec: a final assistant message (prefill) is refused, a ``tool_result`` answers the assistant turn just
    before it, a named tool is one of ``tools`` (docs/API.md)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [
        if_then(_FORCED, _SOME_TOOLS), {"not": {"allOf": [_FORCED, _JSON_OUTPUT]}}]})
    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL]
    system: str | list[TextBlock] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: Metadata | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None  # accepted: the server never edits the context
    # known, refused (ddtree_serve/server/http/serving_messages.py REFUSED)
    service_tier: Any = Field(None, json_schema_extra=only_null("one tier is served"))
    container: Any = Field(None, json_schema_extra=only_null("no code-execution containers"))
    mcp_servers: Any = Field(None, json_schema_extra=only_null("no MCP connector"))
    output_format: Any = Field(None, json_schema_extra=only_null("use output_config.format"))
    inference_geo: Any = Field(None, json_schema_extra=only_null("served where this server runs"))
    speed: Any = Field(None, json_schema_extra=only_null("one speed is served"))
    diagnostics: Any = Field(None, json_schema_extra=only_null("no diagnostics"))
    user_profile_id: Any = Field(None, json_schema_extra=only_null("no user profiles"))
    workspace_id: Any = Field(None, json_schema_extra=only_null("no workspaces"))


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without ``max_tokens`` (Anthropic's; given, it is
    accepted and unused). The prompt is rendered exactly as /v1/messages renders it."""

    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] = 1


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- errors -------------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
