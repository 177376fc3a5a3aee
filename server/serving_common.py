"""Pieces shared by the chat and completion endpoints: request parsing, errors, sampling parameters,
disconnect watching, SSE framing and per-choice accumulation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from model_executor.sampling_params import SamplingParams
from server.io_struct import TextOut
from server.protocol import SpecStats, UsageInfo, error_body
from server.tokenizer_manager import TokenizerManager

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


_MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "input_audio", "audio_url")


def parse_body(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        for err in errors:
            if err["loc"][-1:] == ("type",) and err.get("input") in _MEDIA_PARTS:
                raise APIError(400, f"{err['input']} content is not supported: this server serves the language "
                                    "model only (no vision tower is loaded); send text parts",
                               param="messages", code="unsupported_content") from None
        err = errors[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON body: {err['msg']}", code="invalid_json") from None
        if err["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        raise APIError(400, f"{'.'.join(loc)}: {err['msg']}", param=param, code="invalid_value") from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def check_serving(tm: TokenizerManager) -> None:
    if not tm.serving:
        raise APIError(503, tm.dead or "the server is starting: the model is not loaded yet",
                       code="service_unavailable")


def make_params(req: Any, max_tokens: int, choice: int, logprobs: int | None) -> SamplingParams:
    params = SamplingParams(
        temperature=float(req.temperature), top_p=float(req.top_p), top_k=int(req.top_k), min_p=float(req.min_p),
        seed=None if req.seed is None else req.seed + choice, max_tokens=int(max_tokens),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    return params


async def watch_disconnect(request: Request, tm: TokenizerManager, rids: list[str]) -> None:
    """Abort ``rids`` when the client goes away (the body has been read, so the next ASGI message of a live
    connection is its disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for rid in rids:
                tm.abort(rid)
            return


@dataclass
class ChoiceAccum:
    text: str = ""
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    accepted_tokens: int = 0
    budget_sum: int = 0
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    error: str | None = None
    error_status: int = 400

    def add(self, out: TextOut) -> None:
        self.text += out.text
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.verify_steps = max(self.verify_steps, out.spec_verify_steps)
        self.accepted_tokens = max(self.accepted_tokens, out.spec_accepted_tokens)
        self.budget_sum = max(self.budget_sum, out.spec_budget_sum)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            if out.error is not None:
                self.error, self.error_status = out.error, out.error_status


def usage_of(choices: list[ChoiceAccum], prompt_tokens: int) -> UsageInfo:
    completion = sum(c.completion_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def spec_of(choices: list[ChoiceAccum]) -> SpecStats:
    return SpecStats.of(sum(c.verify_steps for c in choices), sum(c.accepted_tokens for c in choices),
                        sum(c.budget_sum for c in choices))


def raise_choice_error(choices: list[ChoiceAccum]) -> None:
    for c in choices:
        if c.error is not None:
            raise APIError(c.error_status, c.error)


def sse(obj: BaseModel | dict) -> str:
    data = obj if isinstance(obj, dict) else obj.model_dump(exclude_none=True)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def first_output(gen: AsyncIterator[tuple[int, TextOut]]) -> tuple[int, TextOut]:
    """Wait for the first output so that an immediate rejection becomes an HTTP error, not a stream."""
    idx, out = await gen.__anext__()
    if out.finished and out.error is not None:
        await gen.aclose()
        raise APIError(out.error_status, out.error)
    return idx, out


async def cancel_task(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
