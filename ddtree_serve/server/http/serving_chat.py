"""POST /v1/chat/completions: chat template, reasoning and tool-call parsing, streaming and not."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.chat_images import chat_images, media_refs
from ddtree_serve.server.http.log_once import LogOnce
from ddtree_serve.server.http.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChoiceLogprobs,
    CompletionTokensDetails,
    DeltaMessage,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    new_id,
)
from ddtree_serve.server.http.serving_common import (
    SSE_DONE,
    APIError,
    ChoiceAccum,
    Generation,
    check_admission,
    make_params,
    param_names,
    spec_of,
    sse,
    start_generation,
    usage_of,
)
from ddtree_serve.server.http.serving_structured import Constraint, constraint_of, reasoning_gate
from ddtree_serve.server.http.thinking import apply_reasoning_effort, apply_thinking_field, reasoning_tokens
from ddtree_serve.server.http.tool_history import template_messages
from ddtree_serve.server.http.tool_prompt import tools_in_system
from ddtree_serve.server.io_struct import DetokenizeReq, GenerateReq, ImageInput
from ddtree_serve.server.parsers import ReasoningParser, ToolCallParser, parse_reasoning, parse_tool_calls
from ddtree_serve.server.tokenizer_manager import InputError, TokenizerManager

logger = logging.getLogger(__name__)


def _messages(req: ChatCompletionRequest, image_marker: str = "", image_parts: bool = False,
              video_marker: str = "") -> list[dict]:
    """The messages as the template takes them. A message with images or videos: with ``image_parts``, a list
    of text, image and video parts (the checkpoint's template renders each, e.g. Kimi's ``render_content``);
    else one string with ``image_marker`` / ``video_marker`` where each image / video stands (for a template
    that renders no media parts)."""
    out = []
    for m in req.messages:
        content = m.parts() if image_parts and m.media() else (m.text(image_marker, video_marker) or "")
        d: dict = {"role": m.role, "content": content}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")),
                     top_logprobs=[TopLogprob(token=a, logprob=alp, bytes=list(a.encode("utf-8"))) for a, alp in top])
        for t, lp, top in entries])


def _tool_rules(req: ChatCompletionRequest) -> tuple[list[str] | None, int | None]:
    """The tool-call parser's rules for ``req``: the names a call may have (the request's tools: another name
    is text) and how many calls are kept (``parallel_tool_calls: false``: the first)."""
    names = [t.function.name for t in req.tools] if req.tools else None
    return names, (1 if req.parallel_tool_calls is False else None)


def _finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    """``tool_calls`` for a reply that ended by itself (``stop``) with tool calls; a reply cut by ``max_tokens``
    or the context stays ``length`` (its unfinished call is not a call: docs/API.md), an aborted one ``abort``."""
    return "tool_calls" if has_calls and engine_reason == "stop" else engine_reason


class ChatHandler:
    """Chat completions. ``clamp``: a ``max_tokens`` beyond the room the context leaves after the prompt is
    lowered to that room (finish ``length``) rather than refused: the agent APIs always, chat completions
    with ``--allow-auto-truncate``."""

    def __init__(self, config: ServerConfig, tm: TokenizerManager, served_model: str, clamp: bool = False) -> None:
        self.config, self.tm, self.served, self.clamp = config, tm, served_model, clamp
        self.log_once = LogOnce(logger)  # unknown body fields, once per name

    def _parsers(self, req: ChatCompletionRequest, constraint: Constraint) -> tuple[
            str | None, str | None, bool, Constraint]:
        """The reasoning and tool-call parsers, whether the reply starts in its reasoning, and ``constraint``
        gated on the reasoning's end where the reply has one (ddtree_serve/server/http/serving_structured.py)."""
        s = self.config.server
        reasoning = s.reasoning_parser if req.separate_reasoning else None
        tools = s.tool_call_parser if (req.tools and req.tool_choice != "none") else None
        kwargs = req.chat_template_kwargs or {}
        thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", True)))
        constraint = reasoning_gate(constraint, self.tm.tokenizer, s.reasoning_parser, thinking)
        # an ungated grammar holds from the first generated token: that reply has no reasoning section
        thinking = thinking and (constraint.after_reasoning or not constraint.active)
        return reasoning, tools, thinking, constraint

    async def prompt(self, req: ChatCompletionRequest) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt ids of ``req`` as the model's template renders it (tools, images expanded to their tokens)
        and the images; a template or image error is a 400 naming ``messages``. Also Anthropic's count_tokens."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        images = await chat_images(self.tm, media_refs(req.messages))

        def encode(image_parts: bool, marker: str, video_marker: str = "",
                   splice: Callable[[str], str] | None = None) -> list[int]:
            parser = self.config.server.tool_call_parser
            messages = template_messages(_messages(req, marker, image_parts, video_marker), parser)
            if tools and parser and self.tm.tools_in_system:  # the template renders none: the system turn holds them
                return self.tm.encode_chat(tools_in_system(messages, tools, parser), None, req.chat_template_kwargs,
                                           req.add_generation_prompt, req.continue_final_message, splice)
            return self.tm.encode_chat(messages, tools, req.chat_template_kwargs, req.add_generation_prompt,
                                       req.continue_final_message, splice)

        try:
            return images.expand(images.render(encode))
        except InputError as e:  # the template's: it comes from 'messages'
            raise APIError(400, str(e), param="messages", code=e.code) from None

    async def handle(self, request: Request, req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        """``req``: the body, validated by the route (ddtree_serve/server/http/api.py)."""
        check_admission(self.tm, req.model, self.served, req.n)
        self.log_once.all([(f"unknown:{k}", f"/v1/chat/completions: unknown field {k!r} ignored")
                           for k in req.unknown_fields])
        req = apply_reasoning_effort(apply_thinking_field(req), self.config.server.reasoning_parser,
                                     getattr(self.tm.tokenizer, "chat_template", None))
        constraint = constraint_of(req, self.config.server.tool_call_parser)
        if req.tools and req.tool_choice != "none" and self.config.server.tool_call_parser is None:
            raise APIError(400, "tools need a tool-call format to parse the reply's calls: start the server with "
                                "--tool-call-parser (kimi_k2 or hermes), or send tool_choice 'none'",
                           param="tools", code="unsupported_value")
        ids, image_inputs = await self.prompt(req)
        max_tokens = req.max_new_tokens  # None: until the request limit (the scheduler resolves it)
        try:
            self.tm.check_length(len(ids), None if self.clamp else max_tokens)
        except InputError as e:  # the prompt's length comes from 'messages'
            raise APIError(400, str(e), param="messages", code=e.code) from None
        reasoning, tool_parser, thinking, constraint = self._parsers(req, constraint)
        base = uuid.uuid4().hex
        det_common = dict(stop=tuple(req.stop_list()), stop_token_ids=tuple(req.stop_token_ids or ()),
                          skip_special_tokens=req.skip_special_tokens and not (reasoning or tool_parser),
                          logprobs=req.logprobs)
        hint = tuple(self.tm.tokenizer.encode(req.prediction.text(), add_special_tokens=False)) \
            if req.prediction is not None else ()
        group = [(GenerateReq(f"{base}-{i}", ids, dataclasses.replace(
                      make_params(req, max_tokens, i, req.num_logprobs, constraint=constraint,
                                  vocab_size=self.tm.vocab_size, defaults=self.tm.sampling_defaults),
                      draft_hint=hint,
                      clamp_max_tokens=self.clamp), image_inputs),
                  DetokenizeReq(f"{base}-{i}", **det_common)) for i in range(req.n)]
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        run = await start_generation(request, self.tm, group,
                                     param_names("messages", max_name, constraint, logprobs="top_logprobs"))
        parsers = (reasoning, tool_parser, thinking)
        if req.stream:
            return StreamingResponse(self._stream(req, run, len(ids), parsers), media_type="text/event-stream")
        return JSONResponse(await self._collect(req, run, len(ids), parsers))

    def _usage(self, acc: list[ChoiceAccum], prompt_len: int, reasoning: str | None,
               reasoning_texts: list[str]) -> UsageInfo:
        """Usage, with ``completion_tokens_details.reasoning_tokens`` when a reasoning parser is on."""
        usage = usage_of(acc, prompt_len)
        if reasoning:
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=reasoning_tokens(self.tm.tokenizer, reasoning_texts))
        return usage

    async def _collect(self, req: ChatCompletionRequest, run: Generation, prompt_len: int, parsers: tuple) -> dict:
        reasoning, tool_parser, thinking = parsers
        acc = await run.collect(req.n)
        choices, reasoning_texts = [], []
        for i, c in enumerate(acc):
            text, reasoning_text = c.text, None
            if reasoning:
                reasoning_text, text = parse_reasoning(reasoning, text, thinking=thinking)
                reasoning_texts.append(reasoning_text)
            calls = []
            if tool_parser:
                text, calls = parse_tool_calls(tool_parser, text, *_tool_rules(req))
            finish = _finish_reason(c.finish_reason, bool(calls))
            msg = ChatResponseMessage(
                content=text if (text or not calls) else None, reasoning_content=reasoning_text or None,
                tool_calls=[ToolCallOut(id=tc.id, type="function", function=FunctionCallOut(
                    name=tc.name, arguments=tc.arguments)) for tc in calls] or None)
            choices.append(ChatCompletionChoice(index=i, message=msg, finish_reason=finish,
                                                logprobs=_logprobs(c.logprobs) if req.logprobs else None))
        resp = ChatCompletionResponse(id=new_id("chatcmpl"), model=self.served, choices=choices,
                                      usage=self._usage(acc, prompt_len, reasoning, reasoning_texts),
                                      spec_stats=spec_of(acc))
        return resp.model_dump(exclude_none=False)

    async def _stream(self, req: ChatCompletionRequest, run: Generation, prompt_len: int,
                      parsers: tuple) -> AsyncIterator[str]:
        reasoning, tool_parser, thinking = parsers
        cid = new_id("chatcmpl")
        rps = [ReasoningParser(reasoning, thinking=thinking) if reasoning else None for _ in range(req.n)]
        tps = [ToolCallParser(tool_parser, *_tool_rules(req)) if tool_parser else None for _ in range(req.n)]
        acc = [ChoiceAccum() for _ in range(req.n)]
        reasoning_texts = ["" for _ in range(req.n)]

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=cid, model=self.served, choices=[choice]))

        failed = False  # an error event ends the stream: [DONE] follows it directly
        async with run:
            for i in range(req.n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for idx, out in run:
                acc[idx].add(out)
                if out.error is not None:
                    yield sse(run.error(out).body())
                    failed = True
                    break
                r_delta, c_delta = rps[idx].feed(out.text) if rps[idx] else ("", out.text)
                if out.finished and rps[idx]:
                    r2, c2 = rps[idx].finish()
                    r_delta, c_delta = r_delta + r2, c_delta + c2
                reasoning_texts[idx] += r_delta
                calls = []
                if tps[idx]:
                    c_delta, calls = tps[idx].feed(c_delta)
                    if out.finished:
                        c3, calls3 = tps[idx].finish()
                        c_delta, calls = c_delta + c3, calls + calls3
                delta = DeltaMessage(
                    content=c_delta or None, reasoning_content=r_delta or None,
                    tool_calls=[ToolCallOut(index=d.index, id=d.id, type="function" if d.id else None,
                                            function=FunctionCallOut(name=d.name, arguments=d.arguments))
                                for d in calls] or None)
                lp = _logprobs(out.logprobs) if (req.logprobs and out.logprobs) else None
                finish = None
                if out.finished:
                    finish = _finish_reason(out.finish_reason, bool(tps[idx] and tps[idx].num_calls))
                if delta.content or delta.reasoning_content or delta.tool_calls or lp or finish:
                    body = ChatCompletionChunk(id=cid, model=self.served, choices=[ChatCompletionStreamChoice(
                        index=idx, delta=delta, logprobs=lp)]).model_dump(exclude_none=True)
                    body["choices"][0]["finish_reason"] = finish
                    if finish:
                        body["spec_stats"] = spec_of([acc[idx]]).model_dump()
                    yield sse(body)
            if req.include_usage and not failed:  # OpenAI: usage comes last, on success only
                yield sse(ChatCompletionChunk(id=cid, model=self.served, choices=[], spec_stats=spec_of(acc),
                                              usage=self._usage(acc, prompt_len, reasoning, reasoning_texts)))
            yield SSE_DONE
