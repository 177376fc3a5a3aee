"""OpenAI-compatible response bodies (chat completions, completions, models, errors, the ``spec_stats``
extension); their request counterparts are ddtree_serve/server/http/protocol.py, which re-exports these."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


# ---- responses ----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # tokens of the reasoning sections (ddtree_serve/server/http/thinking.py)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # chat, with a reasoning parser on


class SpecStats(BaseModel):
    """Speculative decoding statistics of one request (summed over its ``n`` choices).
    ``verify_steps``: decode steps that verified a draft tree of at least one node; ``plain_steps``: decode
    steps without one (a plain decode forward: no speculation, an ``auto`` budget of 0, or no node fit).
    ``acceptance_length``: tokens emitted per verify step (accepted drafts + the bonus token), over verify
    steps only (0 without any). ``mean_budget``: draft tree nodes offered per verify step (fixed with an
    integer budget, fewer near ``max_tokens``; chosen per step with ``auto``). ``accepted_by_source``:
    accepted draft tokens by the draft source that proposed them (``dflash``, ``suffix``; they add up to
    ``accepted_tokens``)."""

    verify_steps: int = 0
    plain_steps: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0
    mean_budget: float = 0.0
    accepted_by_source: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, verify_steps: int, accepted_tokens: int, budget_sum: int = 0, accepted_suffix: int = 0,
           plain_steps: int = 0) -> SpecStats:
        tau = (accepted_tokens + verify_steps) / verify_steps if verify_steps else 0.0
        mean = budget_sum / verify_steps if verify_steps else 0.0
        return cls(verify_steps=verify_steps, plain_steps=plain_steps, accepted_tokens=accepted_tokens, acceptance_length=round(tau, 4),
                   mean_budget=round(mean, 4),
                   accepted_by_source={"dflash": accepted_tokens - accepted_suffix, "suffix": accepted_suffix})


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(BaseModel):
    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    spec_stats: SpecStats | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    spec_stats: SpecStats | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_stats: SpecStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ddtree-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            503: "service_unavailable"}.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code or str(status))
                         ).model_dump()
