"""POST /tokenize and POST /detokenize, shaped as vLLM's (SGLang's /detokenize ``text`` is given too).

/tokenize takes either ``prompt`` (text, ``add_special_tokens`` default true) or ``messages`` (chat messages as
/v1/chat/completions takes them, with ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` default
true, ``continue_final_message``, ``add_special_tokens`` default false): the chat form gives exactly the prompt
tokens /v1/chat/completions would generate from (Kimi's tool-call ids rewritten likewise:
ddtree_serve/server/http/tool_history.py). Answer: ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` only with ``return_token_strs``). /detokenize takes ``tokens`` and answers
``{"prompt": text, "text": text}``. Both are outside /v1 and so open without the API key (as vLLM's are);
errors have OpenAI's shape.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddtree_serve.server.http.chat_bridge import chat_request
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatMessage, ErrorResponse, Tool
from ddtree_serve.server.http.protocol_rules import has, if_then, needs
from ddtree_serve.server.http.protocol_tools import INTEGRAL
from ddtree_serve.server.http.protocol_tools import REQUEST_CONFIG as _REQ
from ddtree_serve.server.http.serving_chat import _messages as chat_messages
from ddtree_serve.server.http.serving_common import check_model
from ddtree_serve.server.http.tool_history import template_messages
from ddtree_serve.server.http.tool_prompt import tools_in_system
from ddtree_serve.server.tokenizer_manager import TokenizerManager

_PROMPT_ONLY = {"properties": {"tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
                                "chat_template_kwargs": {"anyOf": [{"type": "null"},
                                                                   {"type": "object", "maxProperties": 0}]},
                                "continue_final_message": {"const": False}}}
# _one_input, published: exactly one of prompt and messages; the chat fields only with messages;
# continue_final_message only with add_generation_prompt false
_TOKENIZE_RULES = [
    {"anyOf": [needs("prompt"), needs("messages")]}, {"not": {"allOf": [needs("prompt"), needs("messages")]}},
    if_then({"not": needs("messages")}, _PROMPT_ONLY),
    if_then(has("continue_final_message", {"const": True}), has("add_generation_prompt", {"const": False})),
]


class TokenizeRequest(BaseModel):
    """Either ``prompt`` or ``messages`` (the rules of ``_one_input`` are in the spec too)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": _TOKENIZE_RULES})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.messages is None and (self.tools or self.chat_template_kwargs or self.continue_final_message):
            raise ValueError("'tools', 'chat_template_kwargs' and 'continue_final_message' need 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("'continue_final_message' needs 'add_generation_prompt': false")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _REQ
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0), INTEGRAL]]  # and below the vocabulary size (not in the spec: the tokenizer's)


class DetokenizeResponse(BaseModel):
    prompt: str
    text: str


def tokenize(tm: TokenizerManager, req: TokenizeRequest) -> list[int]:
    tok = tm.tokenizer
    if req.prompt is not None:
        return list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
    if getattr(tok, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template; tokenize a 'prompt'", param="messages")
    chat = chat_request({"messages": [m.model_dump(exclude_none=True) for m in req.messages or []]})
    if any(m.media() for m in chat.messages):
        raise APIError(400, "/tokenize does not take images or videos; send text parts (an image's token count: "
                            "docs/API.md, Images)", param="messages", code="unsupported_content")
    parser = tm.config.server.tool_call_parser
    messages = template_messages(chat_messages(chat), parser)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if tools and parser and tm.tools_in_system:  # as chat completions: the system turn holds them
        messages, tools = tools_in_system(messages, tools, parser), None
    try:
        text = tok.apply_chat_template(
            messages, tools=tools,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            tokenize=False, **(req.chat_template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - template errors are input errors
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return list(tok.encode(text, add_special_tokens=bool(req.add_special_tokens)))


def add_tokenize_routes(app: FastAPI, tm: TokenizerManager, served: str) -> None:
    errors = {400: {"model": ErrorResponse, "description": "invalid request"},
              404: {"model": ErrorResponse, "description": "unknown model"}}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        """Token ids of a prompt or of chat messages (vLLM's shape)."""
        check_model(body.model, served)
        ids = tokenize(tm, body)
        strs = tm.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=tm.max_context_len, tokens=ids,
                                             token_strs=strs).model_dump())

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        """The text of token ids (vLLM's ``prompt``; SGLang's ``text``)."""
        check_model(body.model, served)
        try:
            tm.check_token_ids(body.tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None
        text = tm.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text, text=text).model_dump())
