"""POST /v1/completions: text or token-id prompts (one or many), streaming and not."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from server.config import ServerConfig
from server.io_struct import DetokenizeReq, GenerateReq
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
)
from server.serving_common import (
    SSE_DONE,
    APIError,
    ChoiceAccum,
    cancel_task,
    check_model,
    check_queue,
    check_serving,
    first_output,
    make_params,
    raise_choice_error,
    spec_of,
    sse,
    usage_of,
    watch_disconnect,
)
from server.tokenizer_manager import InputError, TokenizerManager


def _logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]], offset: int) -> CompletionLogprobs:
    lp = CompletionLogprobs()
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

    async def handle(self, request: Request, req: CompletionRequest) -> JSONResponse | StreamingResponse:
        """``req``: the body, validated by the route (server/api.py)."""
        check_model(req.model, self.served)
        check_serving(self.tm)
        check_queue(self.tm, req.n * len(req.prompts()))
        prompts: list[list[int]] = []
        texts: list[str] = []
        try:
            for p in req.prompts():
                ids = self.tm.encode_text(p) if isinstance(p, str) else list(p)
                if not isinstance(p, str):
                    self.tm.check_token_ids(ids)
                self.tm.check_length(len(ids), req.max_tokens)
                prompts.append(ids)
                texts.append(p if isinstance(p, str) else self.tm.decode(ids))
        except InputError as e:
            raise APIError(400, str(e), param="prompt") from None
        base = uuid.uuid4().hex
        group = []
        for pi, ids in enumerate(prompts):
            for j in range(req.n):
                rid = f"{base}-{pi * req.n + j}"
                group.append((GenerateReq(rid, ids, make_params(req, req.max_tokens, j, req.logprobs)),
                              DetokenizeReq(rid, stop=tuple(req.stop_list()),
                                            stop_token_ids=tuple(req.stop_token_ids or ()),
                                            logprobs=req.logprobs is not None)))
        prompt_tokens = sum(len(p) for p in prompts)
        gen = self.tm.generate(group)
        watcher = asyncio.create_task(watch_disconnect(request, self.tm, [g[0].rid for g in group]))
        try:
            first = await first_output(gen)
        except BaseException:
            await cancel_task(watcher)
            raise
        echo = [texts[i // req.n] if req.echo else "" for i in range(len(group))]
        if req.stream:
            return StreamingResponse(self._stream(req, gen, first, watcher, echo, prompt_tokens),
                                     media_type="text/event-stream")
        try:
            acc = [ChoiceAccum() for _ in group]
            acc[first[0]].add(first[1])
            async with contextlib.aclosing(gen):
                async for idx, out in gen:
                    acc[idx].add(out)
        finally:
            await cancel_task(watcher)
        raise_choice_error(acc)
        choices = [CompletionChoice(index=i, text=echo[i] + c.text, finish_reason=c.finish_reason,
                                    logprobs=_logprobs(c.logprobs, len(echo[i])) if req.logprobs is not None else None)
                   for i, c in enumerate(acc)]
        resp = CompletionResponse(id=new_id("cmpl"), model=self.served, choices=choices,
                                  usage=usage_of(acc, prompt_tokens), spec_stats=spec_of(acc))
        return JSONResponse(resp.model_dump())

    async def _stream(self, req: CompletionRequest, gen: AsyncIterator, first: tuple, watcher: asyncio.Task,
                      echo: list[str], prompt_tokens: int) -> AsyncIterator[str]:
        cid = new_id("cmpl")
        acc = [ChoiceAccum() for _ in echo]
        offsets = [len(e) for e in echo]

        async def outputs() -> AsyncIterator[tuple]:
            yield first
            async for item in gen:
                yield item

        try:
            for i, e in enumerate(echo):
                if e:
                    yield sse(CompletionResponse(id=cid, model=self.served,
                                                 choices=[CompletionChoice(index=i, text=e)]))
            async with contextlib.aclosing(gen):
                async for idx, out in outputs():
                    acc[idx].add(out)
                    if out.error is not None:
                        yield sse(APIError(out.error_status, out.error).body())
                        break
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
            if req.include_usage:
                yield sse(CompletionResponse(id=cid, model=self.served, choices=[],
                                             usage=usage_of(acc, prompt_tokens), spec_stats=spec_of(acc)))
            yield SSE_DONE
        finally:
            await cancel_task(watcher)
