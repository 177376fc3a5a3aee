"""The messages of a chat request: text, image and video parts, a message with OpenAI's per-role rules (validated and
published as JSON Schema if/then), a predicted output, and Moonshot's thinking switch.
ddtree_serve/server/http/protocol.py re-exports them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddtree_serve.server.http.protocol_rules import needs
from ddtree_serve.server.http.protocol_tools import REQUEST_CONFIG as _REQ
from ddtree_serve.server.http.protocol_tools import ToolCallMsg


class TextPart(BaseModel):
    model_config = _REQ
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _REQ
    url: str  # a data: URL, or an http(s) URL from an allowed host (ddtree_serve/server/multimodal/frontend.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's own resize rule applies


class ImagePart(BaseModel):
    """An image (models with a vision tower; a 400 otherwise), in 'user' messages."""

    model_config = _REQ
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    model_config = _REQ
    url: str  # a data:video/...;base64 URL, or an http(s) URL from an allowed host


class VideoPart(BaseModel):
    """A video (models that take video; a 400 otherwise), in 'user' messages (vLLM's ``video_url`` part)."""

    model_config = _REQ
    type: Literal["video_url"]
    video_url: VideoURL


def _if_role(roles: list[str], then: dict) -> dict:
    return {"if": {"properties": {"role": {"enum": roles}}, "required": ["role"]}, "then": then}


# the role rules of ChatMessage._role_rules, published in the OpenAPI spec (JSON Schema if/then)
_ROLE_RULES = [
    _if_role(["tool"], needs("content", "tool_call_id")),
    _if_role(["system", "developer", "user"], needs("content")),
    _if_role(["assistant"], {"anyOf": [needs("content"), {"required": ["tool_calls"],
                                                           "properties": {"tool_calls": {"type": "array",
                                                                                         "minItems": 1}}}]}),
    _if_role(["system", "developer", "user", "tool"], {"properties": {"tool_calls": {"type": "null"}}}),
    # image and video parts only in user messages (ddtree_serve/server/multimodal/frontend.py)
    _if_role(["system", "developer", "assistant", "tool"], {"properties": {"content": {"anyOf": [
        {"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "not": {"properties": {"type": {"enum": ["image_url", "video_url"]}}, "required": ["type"]}}}]}}}),
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": _ROLE_RULES})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | VideoPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMsg] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        """OpenAI's per-role rules: a tool message answers a call (content and tool_call_id); an assistant
        message has content or tool_calls; other roles have content; only assistants make tool calls."""
        if self.role == "tool":
            if self.content is None or self.tool_call_id is None:
                raise ValueError("a 'tool' message needs 'content' and 'tool_call_id'")
        elif self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an 'assistant' message needs 'content' or 'tool_calls'")
        elif self.content is None:
            raise ValueError(f"a {self.role!r} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only 'assistant' messages carry 'tool_calls' (got role {self.role!r})")
        if self.role != "user" and self.media():
            raise ValueError(f"image_url and video_url parts belong in 'user' messages (got role {self.role!r})")
        return self

    def text(self, image_marker: str = "", video_marker: str = "") -> str | None:
        """The content as one string; each image part becomes ``image_marker`` where it stands, each video part
        ``video_marker``."""
        if isinstance(self.content, list):
            return "".join(p.text if isinstance(p, TextPart) else image_marker if isinstance(p, ImagePart)
                           else video_marker for p in self.content)
        return self.content

    def parts(self) -> list[dict[str, Any]]:
        """The content as the chat template takes a multimodal message (transformers' and vLLM's convention):
        ``{"type": "text", "text": ...}``, ``{"type": "image"}`` and ``{"type": "video"}`` parts in order."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content or ""}]
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                else {"type": "image"} if isinstance(p, ImagePart) else {"type": "video"} for p in self.content]

    def image_urls(self) -> list[str]:
        return [url for kind, url, _ in self.media() if kind == "image"]

    def media(self) -> list[tuple[str, str, int]]:
        """(kind "image" or "video", URL, index in ``content``) of each media part, in order."""
        if not isinstance(self.content, list):
            return []
        return [("image", p.image_url.url, j) if isinstance(p, ImagePart) else ("video", p.video_url.url, j)
                for j, p in enumerate(self.content) if not isinstance(p, TextPart)]


class Prediction(BaseModel):
    """OpenAI's predicted output: text the reply is expected to repeat. It changes speed only: with ddtree and
    suffix drafts its tokens are indexed after the prompt, so the reply's copies of it are drafted."""

    model_config = _REQ
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class MoonshotThinking(BaseModel):
    """Moonshot's thinking switch on chat completions (Kimi K2.x): ``{"type": "enabled" | "disabled"}``, the
    template's ``thinking`` / ``enable_thinking`` (ddtree_serve/server/http/thinking.py). ``keep`` (which past
    reasoning stays in the prompt) is refused: the template decides (docs/API.md)."""

    model_config = _REQ
    type: Literal["enabled", "disabled"]
    keep: None = Field(None, json_schema_extra={"type": "null"})

    @field_validator("keep", mode="before")
    @classmethod
    def _keep_refused(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("thinking.keep is not supported: the chat template decides which past reasoning stays "
                             "in the prompt (every history message's reasoning_content reaches it); a template "
                             "that reads preserve_thinking takes it from chat_template_kwargs")
        return v
