"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.log_once import LogOnce
from ddtree_serve.server.http.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SpecStats,
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
from ddtree_serve.server.http.serving_structured import constraint_of
from ddtree_serve.server.io_struct import DetokenizeReq, GenerateReq
from ddtree_serve.server.tokenizer_manager import InputError, TokenizerManager

logger = logging.getLogger(__name__)


def _logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int,
              prompt: list[tuple[str, float | None, list[tuple[str, float]] | None]] | None = None
              ) -> CompletionLogprobs:
    """OpenAI's legacy layout. With ``prompt`` (echo): the prompt's tokens first, text offsets from 0 (the
    first token's logprob and top alternatives are null: it has no context), then the completion's tokens,
    offsets from ``offset`` (the length of the echoed prompt text)."""
    lp = CompletionLogprobs()
    pos = 0
    for t, v, top in prompt or ():
        lp.tokens.append(t)
        lp.token_logprobs.append(v)
        lp.top_logprobs.append(None if top is None else dict(top))
        lp.text_offset.append(pos)
        pos += len(t)
    for t, v, top in entries:
        lp.tokens.append(t)
        lp.token_logprobs.append(v)
        lp.top_logprobs.append(dict(top))
        lp.text_offset.append(offset)
        offset += len(t)
    return lp


class CompletionHandler:
    def __init__(self, config: ServerConfig, tm: TokenizerManager, served_model: str) -> None:
        self.config, self.tm, self.served = config, tm, served_model
        self.log_once = LogOnce(logger)  # unknown body fields, once per name

    async def handle(self, request: Request, req: CompletionRequest) -> JSONResponse | StreamingResponse:
        """``req``: the body, validated by the route (ddtree_serve/server/http/api.py)."""
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be at least 1; 0 is allowed only with echo (to score the "
                                "prompt alone)", param="max_tokens", code="invalid_value")
        check_admission(self.tm, req.model, self.served, req.n * len(req.prompts()))
        self.log_once.all([(f"unknown:{k}", f"/v1/completions: unknown field {k!r} ignored")
                           for k in req.unknown_fields])
        constraint = constraint_of(req)
        prompts: list[list[int]] = []
        texts: list[str] = []
        try:
            for p in req.prompts():
                ids = self.tm.encode_text(p) if isinstance(p, str) else list(p)
                if not isinstance(p, str):
                    self.tm.check_token_ids(ids)
                clamp = self.config.server.allow_auto_truncate and bool(req.max_tokens)  # not echo's 0
                self.tm.check_length(len(ids), None if clamp else req.max_tokens)
                prompts.append(ids)
                texts.append(p if isinstance(p, str) else self.tm.decode(ids))
        except InputError as e:
            raise APIError(400, str(e), param="prompt", code=e.code) from None
        if req.max_tokens == 0 and req.logprobs is None:
            return self._echo_only(req, texts, sum(len(p) for p in prompts))
        prompt_logprobs = req.logprobs if req.echo else None  # vLLM: echo scores the prompt at the same k
        base = uuid.uuid4().hex
        group = []
        for pi, ids in enumerate(prompts):
            for j in range(req.n):
                rid = f"{base}-{pi * req.n + j}"
                params = make_params(req, req.max_tokens, j, req.logprobs, prompt_logprobs, constraint,
                                     self.tm.vocab_size, self.tm.sampling_defaults)
                if self.config.server.allow_auto_truncate and req.max_tokens:
                    params = dataclasses.replace(params, clamp_max_tokens=True)
                group.append((GenerateReq(rid, ids, params),
                              DetokenizeReq(rid, stop=tuple(req.stop_list()),
                                            stop_token_ids=tuple(req.stop_token_ids or ()),
                                            logprobs=req.logprobs is not None,
                                            skip_special_tokens=req.skip_special_tokens)))
        prompt_tokens = sum(len(p) for p in prompts)
        run = await start_generation(request, self.tm, group, param_names("prompt", constraint=constraint))
        echo = [texts[i // req.n] if req.echo else "" for i in range(len(group))]
        if req.stream:
            return StreamingResponse(self._stream(req, run, echo, prompt_tokens), media_type="text/event-stream")
        acc = await run.collect(len(group))
        choices = [CompletionChoice(index=i, text=echo[i] + c.text, finish_reason=c.finish_reason,
                                    logprobs=_logprobs(c.logprobs, len(echo[i]), c.prompt_logprobs)
                                    if req.logprobs is not None else None)
                   for i, c in enumerate(acc)]
        resp = CompletionResponse(id=new_id("cmpl"), model=self.served, choices=choices,
                                  usage=usage_of(acc, prompt_tokens, req.n), spec_stats=spec_of(acc))
        return JSONResponse(resp.model_dump())

    async def _stream(self, req: CompletionRequest, run: Generation, echo: list[str], prompt_tokens: int
                      ) -> AsyncIterator[str]:
        cid = new_id("cmpl")
        acc = [ChoiceAccum() for _ in echo]
        offsets = [len(e) for e in echo]
        # with logprobs, a choice's echo waits for its first output, which carries the prompt's logprobs
        held = [bool(e) and req.logprobs is not None for e in echo]
        failed = False  # an error event ends the stream: [DONE] follows it directly
        async with run:
            for i, e in enumerate(echo):
                if e and not held[i]:
                    yield sse(CompletionResponse(id=cid, model=self.served,
                                                 choices=[CompletionChoice(index=i, text=e)]))
            async for idx, out in run:
                acc[idx].add(out)
                if out.error is not None:
                    yield sse(run.error(out).body())
                    failed = True
                    break
                if held[idx]:
                    held[idx] = False
                    lp = _logprobs([], 0, out.prompt_logprobs or [])
                    yield sse(CompletionResponse(id=cid, model=self.served, choices=[
                        CompletionChoice(index=idx, text=echo[idx], logprobs=lp)]))
                lp = None
                if req.logprobs is not None and out.logprobs:
                    lp = _logprobs(out.logprobs, offsets[idx])
                offsets[idx] += len(out.text)
                if out.text or out.finished or lp:
                    body = CompletionResponse(id=cid, model=self.served, choices=[CompletionChoice(
                        index=idx, text=out.text, logprobs=lp)]).model_dump(exclude_none=True)
                    body["choices"][0]["finish_reason"] = out.finish_reason if out.finished else None
                    if out.finished:
                        body["spec_stats"] = spec_of([acc[idx]]).model_dump()
                    yield sse(body)
            if req.include_usage and not failed:  # OpenAI: usage comes last, on success only
                yield sse(CompletionResponse(id=cid, model=self.served, choices=[],
                                             usage=usage_of(acc, prompt_tokens, req.n), spec_stats=spec_of(acc)))
            yield SSE_DONE

    def _echo_only(self, req: CompletionRequest, texts: list[str], prompt_tokens: int
                   ) -> JSONResponse | StreamingResponse:
        """``echo`` with ``max_tokens`` 0 and no logprobs: the prompt back, nothing to run on the model."""
        choices = [CompletionChoice(index=i, text=texts[i // req.n], finish_reason="length")
                   for i in range(len(texts) * req.n)]
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
        none = SpecStats.of(0, 0)  # no decode step ran: every count 0, as any response reports them
        resp = CompletionResponse(id=new_id("cmpl"), model=self.served, choices=choices, usage=usage, spec_stats=none)
        if not req.stream:
            return JSONResponse(resp.model_dump())

        async def events() -> AsyncIterator[str]:
            for c in choices:
                yield sse(CompletionResponse(id=resp.id, model=self.served, choices=[c], spec_stats=none))
            if req.include_usage:
                yield sse(CompletionResponse(id=resp.id, model=self.served, choices=[], usage=usage, spec_stats=none))
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")
