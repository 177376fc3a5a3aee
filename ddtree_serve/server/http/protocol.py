"""OpenAI-compatible request/response models (chat completions, completions, models, errors).

Requests are validated strictly from the JSON body: a wrong type (``"temperature": "hot"``) or a value out
of range is a 400 naming the parameter. Unknown extra fields are ignored, as OpenAI clients send several
that this server does not use (``user`` ...). Tool and ``response_format`` models live in
ddtree_serve/server/http/protocol_tools.py; structured output (``response_format``, ``regex``, ``ebnf``, a forced
``tool_choice``) maps to grammar constraints in ddtree_serve/server/http/serving_structured.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ddtree_serve.server.http.protocol_chat_message import (  # noqa: F401 - re-exported
    ChatMessage,
    ImagePart,
    ImageURL,
    MoonshotThinking,
    Prediction,
    TextPart,
)
from ddtree_serve.server.http.protocol_outputs import (  # noqa: F401 - re-exported: the OpenAI models' public home
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SpecStats,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    error_body,
    new_id,
)
from ddtree_serve.server.http.protocol_rules import (
    CHAT_TOOL_RULES,
    CONTINUE_RULE,
    EBNF,
    INT64_MAX,
    INT64_MIN,
    JSON_FORMAT,
    JSON_SAFE_INT,
    REGEX,
    STREAM_OPTIONS_RULE,
    at_most_one,
    has,
    if_then,
)
from ddtree_serve.server.http.protocol_tools import (  # noqa: F401 - re-exported: the request models' public home
    INTEGRAL,
    FunctionCallMsg,
    FunctionDef,
    Int,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCallMsg,
    ToolChoice,
    ToolChoiceFunction,
)
from ddtree_serve.server.http.protocol_tools import REQUEST_CONFIG as _REQ

# ---- requests -----------------------------------------------------------------------------------------
# OpenAI's reasoning effort levels; applied through the model's thinking switch (ddtree_serve/server/http/thinking.py)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class StreamOptions(BaseModel):
    model_config = _REQ
    include_usage: bool = False


# OpenAI accepts null for these and means the default; so does this server (the spec publishes null for each)
NULL_MEANS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "n", "stream", "ignore_eos", "logprobs",
                      "max_tokens", "echo", "separate_reasoning")


def null_default_schema(extra: dict[str, Any] | None = None) -> Any:
    """A model-level ``json_schema_extra``: merge ``extra`` and publish null for ``NULL_MEANS_DEFAULT``."""
    def apply(schema: dict[str, Any]) -> None:
        schema.update(extra or {})
        for name in NULL_MEANS_DEFAULT:
            prop = schema.get("properties", {}).get(name)
            if prop is None or any(alt.get("type") == "null" for alt in prop.get("anyOf", [])):
                continue
            inner = {k: prop.pop(k) for k in list(prop) if k not in ("title", "description", "default")}
            prop["anyOf"] = [inner, {"type": "null"}]
    return apply


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. ``best_of`` (completions) is accepted only where it means nothing
    more than ``n``: no candidates are ranked server-side. null for a field of ``NULL_MEANS_DEFAULT`` is its
    default, as OpenAI's API treats it."""

    model_config = ConfigDict(**{**_REQ, "json_schema_extra": null_default_schema()})
    _unknown: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown(cls, data: Any, handler: Any) -> Any:
        """Record the body's field names this model does not know (ignored; the handler logs each once)."""
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _SamplingFields):
            model._unknown = tuple(k for k in data if isinstance(k, str) and k not in cls.model_fields)
        return model

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """The body's fields this server does not know (ignored, as OpenAI's API ignores them)."""
        return self._unknown
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] = Field(-1, json_schema_extra={"not": {"const": 0}})  # -1 (off) or >= 1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # an int64; published within JSON's exact integers (+-2**53), which every JSON tool compares exactly
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX, json_schema_extra=JSON_SAFE_INT), INTEGRAL] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Int] | None = None
    n: Annotated[int, Field(ge=1, le=64), INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # None: 0 (off)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # None: 0 (off)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # None: 1 (off)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={  # token id (digits) -> [-100, 100]
        "anyOf": [{"type": "object", "additionalProperties": False,
                   "patternProperties": {"^[0-9]+$": {"type": "number", "minimum": -100, "maximum": 100}}},
                  {"type": "null"}]})
    user: str | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, min_length=1)  # SGLang extension: the output matches this regex
    ebnf: str | None = Field(None, min_length=1)  # SGLang extension: the output matches this EBNF grammar
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 0  # vLLM: no EOS / stop_token_ids before this many tokens
    skip_special_tokens: bool = True  # vLLM: special tokens are left out of the text
    # OpenAI fields this server cannot honour: refused when set (a 400 naming the field), never ignored
    store: Literal[False] | None = None  # no stored completions
    metadata: Annotated[dict[str, str], Field(max_length=0)] | None = None  # only with store
    service_tier: Literal["auto", "default"] | None = None  # one tier: auto / default mean the same here

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not re.fullmatch(r"[0-9]+", key):
                raise ValueError(f"keys must be token ids (integers >= 0 as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {bias!r} for token {key}")
        return v

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (the JSON object's keys are strings)."""
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("store", "metadata", "service_tier", mode="before")
    @classmethod
    def _refused_sampling(cls, v: Any, info: ValidationInfo) -> Any:
        why = {"store": "stored completions are not kept (send store: false or leave it out)",
               "metadata": "metadata is kept only with stored completions, which this server does not keep",
               "service_tier": "one service tier: 'auto' or 'default'"}
        bad = {"store": v is not None and v is not False, "metadata": bool(v),
               "service_tier": v is not None and v not in ("auto", "default")}
        if bad[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported: {why[info.field_name]}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options needs stream: true")
        return v


CHAT_REFUSED = {  # chat fields refused whenever set (field -> why)
    "audio": "no audio output (this server serves a text model)",
    "web_search_options": "no web search here; search on the client and send the results as messages or tool "
                          "results",
    "verbosity": "no verbosity levels; bound the reply with max_tokens",
}


class ChatCompletionRequest(_SamplingFields):
    """Cross-field rules, published in the spec: ``top_logprobs`` only with ``logprobs: true``; at most one
    output constraint (``response_format`` json, ``regex``, ``ebnf``, a forced ``tool_choice``); a forced
    ``tool_choice`` needs ``tools`` (ddtree_serve/server/http/serving_structured.py). Not in the spec: a named
    ``tool_choice`` must be one of ``tools``, a ``tool`` message must answer an assistant turn with
    ``tool_calls``, and ``reasoning_effort`` needs a model with a thinking switch (docs/API.md)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=null_default_schema({"allOf": [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}, *CHAT_TOOL_RULES,
        CONTINUE_RULE]}))  # not STREAM_OPTIONS_RULE: one rule more and schemathesis cannot canonicalise the schema
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None  # only with logprobs: true (as OpenAI)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (the first one the model makes)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None  # none/minimal: thinking off; else on (or a 400)
    thinking: MoonshotThinking | None = None  # Moonshot's switch: the template's thinking / enable_thinking
    separate_reasoning: bool = True
    add_generation_prompt: bool = True  # vLLM: the template's assistant header after the messages
    continue_final_message: bool = False  # vLLM: the reply continues the last (assistant) message
    prediction: Prediction | None = None  # OpenAI predicted output: a suffix-draft source (docs/API.md)
    # OpenAI's deprecated forms of tools / tool_choice: refused (400), never ignored; send tools instead
    functions: list[dict[str, Any]] | None = Field(None, max_length=0, json_schema_extra={"deprecated": True})
    function_call: None = Field(None, json_schema_extra={"deprecated": True})
    # OpenAI fields that would change the reply and that this server cannot honour: refused, never ignored
    modalities: list[Literal["text"]] | None = None  # ["audio"] asks for speech
    audio: None = None
    web_search_options: None = None
    verbosity: None = None

    @model_validator(mode="after")
    def _continue_final_message(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        return self

    @field_validator("audio", "web_search_options", "verbosity", mode="before")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"{info.field_name} is not supported: {CHAT_REFUSED[info.field_name]}")
        return v

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _legacy_functions(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v != []:  # an empty list asks for nothing
            other = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"the legacy '{info.field_name}' field is not supported: use '{other}'")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("messages")
    @classmethod
    def _tool_answers_a_call(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        """As OpenAI: a 'tool' message must follow an assistant message with 'tool_calls' (or another tool
        message answering the same turn)."""
        for i, m in enumerate(v):
            if m.role == "tool":
                j = i - 1
                while j >= 0 and v[j].role == "tool":
                    j -= 1
                if j < 0 or v[j].role != "assistant" or not v[j].tool_calls:
                    raise ValueError(f"messages[{i}]: a 'tool' message must answer a preceding assistant "
                                     "message with 'tool_calls'")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_Text = Annotated[str, Field(min_length=1)]  # a prompt text: at least one token
_Ids = Annotated[list[Annotated[int, Field(ge=0), INTEGRAL]], Field(min_length=1)]  # token ids (< the vocabulary: not in the spec)


class CompletionRequest(_SamplingFields):
    """Cross-field rules, published in the spec: ``max_tokens: 0`` only with ``echo``; at most one output
    constraint; ``best_of`` equal to ``n`` (published: 1, with ``n`` 1)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=null_default_schema({"allOf": [
        {"if": {"not": {"required": ["echo"], "properties": {"echo": {"const": True}}}},  # max_tokens 0: echo only
         "then": {"properties": {"max_tokens": {"minimum": 1}}}},
        *at_most_one(JSON_FORMAT, REGEX, EBNF), if_then(has("best_of", {"const": 1}), {"properties": {"n": {"const": 1}}}),
        STREAM_OPTIONS_RULE]}))
    prompt: _Text | Annotated[list[_Text], Field(min_length=1)] | _Ids | Annotated[list[_Ids], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 16  # 0 only with echo: score the prompt alone (checked by the handler)
    logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    echo: bool = False
    # accepted only equal to n (candidates are not ranked server-side); published as 1 (with n 1) or null: JSON
    # Schema cannot compare two fields, and one alternative per n is more than schema tools take
    best_of: Annotated[int, Field(ge=1, le=64), INTEGRAL] | None = Field(None, json_schema_extra={
        "anyOf": [{"const": 1}, {"type": "null"}]})
    suffix: str | None = Field(None, max_length=0)  # insertion (text after the completion) is not supported

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of ({v}) must equal n ({n}): this server does not rank candidates "
                             "server-side; send n and choose among the choices")
        return v

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        if isinstance(v, str) and v:
            raise ValueError("suffix (text after the completion, insertion) is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of independent prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
