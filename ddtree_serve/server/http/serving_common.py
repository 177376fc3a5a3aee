"""Pieces shared by the chat and completion endpoints: request parsing, errors, admission checks, sampling
parameters, starting a group of requests (first output, disconnect watching), SSE framing and per-choice
accumulation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import PromptTokensDetails, SpecStats, UsageInfo
from ddtree_serve.server.io_struct import DetokenizeReq, GenerateReq, TextOut
from ddtree_serve.server.tokenizer_manager import TokenizerManager

if TYPE_CHECKING:
    from ddtree_serve.server.http.serving_structured import Constraint

M = TypeVar("M", bound=BaseModel)


RETRY_AFTER_S = 1  # Retry-After of a 503 for a full queue


_MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "input_audio", "audio_url")


def validation_error(errors: list[dict]) -> APIError:
    """The 400 for a request body that failed validation (pydantic errors, as FastAPI reports them with a
    leading ``"body"`` in each location): names the parameter, never a 422."""
    served = [e for e in errors if "input_image" in e["loc"] and e["loc"][-1] != "type"]  # Responses' own part
    for err in [] if served else errors:
        if err["loc"][-1:] == ("type",) and err.get("input") in _MEDIA_PARTS \
                and err["input"] not in ("image_url", "video_url"):
            return APIError(400, f"{err['input']} content is not supported: send text parts, images as image_url "
                                 "parts or videos as video_url parts (models with a vision tower; docs/API.md)",
                            param="messages", code="unsupported_content")
    err = (served or errors)[0]
    loc = [str(x) for x in err["loc"]][1 if err["loc"][:1] == ("body",) else 0:]
    if err["type"] == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err["msg"])
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    if err["type"] in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return APIError(400, "the request body must be a JSON object")
    if err["type"] == "missing" and not loc:
        return APIError(400, "the request body is empty: send a JSON object")
    param = loc[0] if loc else None
    return APIError(400, f"{'.'.join(loc)}: {err['msg']}", param=param, code="invalid_value")


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a raw JSON body against ``model`` (the 400 of ``validation_error`` on failure)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def check_serving(tm: TokenizerManager) -> None:
    """503 unless the server admits requests: starting, a dead process, or draining at shutdown (then with
    Retry-After: another replica can take the request)."""
    if tm.draining and tm.dead is None:
        raise APIError(503, "the server is shutting down: it admits no new requests", code="service_unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    if not tm.serving:
        raise APIError(503, tm.dead or "the server is starting: the model is not loaded yet",
                       code="service_unavailable")


def check_queue(tm: TokenizerManager, n: int) -> None:
    """503 with Retry-After when ``n`` more requests would overfill the waiting queue."""
    if tm.queue_full(n):
        raise APIError(503, f"the server is busy: more than max_waiting_requests "
                            f"({tm.config.server.max_waiting_requests}) requests are waiting; retry later",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


def check_admission(tm: TokenizerManager, requested_model: str | None, served: str, n: int) -> None:
    """The checks before any work: the model name (404), a serving engine (503), room in the queue for ``n``
    requests (503 + Retry-After)."""
    check_model(requested_model, served)
    check_serving(tm)
    check_queue(tm, n)


def param_names(prompt: str, max_tokens: str = "max_tokens", constraint: Constraint | None = None,
                logprobs: str = "logprobs") -> dict[str, str]:
    """How one API names the engine's request fields, for the ``param`` of an engine refusal (``TextOut.
    error_param``): the prompt (``messages`` / ``prompt``), the output length, the grammar (``response_format``,
    ``regex``, ``ebnf``, or ``tool_choice`` for a forced tool call) and the logprobs. Other engine names
    (``temperature``, ``logit_bias``, ...) are the APIs' own."""
    forced = constraint is not None and constraint.forces_tools
    grammar = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}
    return {"prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, "prompt_logprobs": "logprobs",
            **{k: "tool_choice" if forced else v for k, v in grammar.items()}}


def engine_error(out: TextOut, names: dict[str, str] | None = None) -> APIError:
    """The APIError of a refused or failed request, its ``param`` the API's name for ``out.error_param``."""
    param = out.error_param if out.error_param is None else (names or {}).get(out.error_param, out.error_param)
    return APIError(out.error_status, out.error or "request failed", param=param if out.error_status < 500 else None)


def sampling_fields(req: Any, defaults: Mapping[str, int | float] | None) -> dict[str, Any]:
    """``req``'s temperature, top_p, top_k, min_p and repetition_penalty: a field the request left out (or sent
    null) takes ``defaults``' value where it has one (``--sampling-defaults model``), else the request model's."""
    fields = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
              "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty}
    for name, value in (defaults or {}).items():
        if name in fields and (name not in req.model_fields_set or getattr(req, name) is None):
            fields[name] = value
    return fields


def make_params(req: Any, max_tokens: int | None, choice: int, logprobs: int | None,
                prompt_logprobs: int | None = None, constraint: Constraint | None = None,
                vocab_size: int | None = None, defaults: Mapping[str, int | float] | None = None) -> SamplingParams:
    """The engine's parameters of choice ``choice``; a value they refuse (``vocab_size``: the model's, for
    ``logit_bias`` ids) is a 400 naming the field. ``defaults``: the server's sampling defaults
    (``sampling_fields``)."""
    s = sampling_fields(req, defaults)
    params = SamplingParams(
        temperature=float(s["temperature"]), top_p=float(s["top_p"]), top_k=int(s["top_k"]), min_p=float(s["min_p"]),
        seed=None if req.seed is None else req.seed + choice, max_tokens=None if max_tokens is None else int(max_tokens),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
        presence_penalty=float(req.presence_penalty or 0.0), frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=float(s["repetition_penalty"]),
        logit_bias=req.logit_bias_ids(),
        prompt_logprobs=prompt_logprobs, min_tokens=int(getattr(req, "min_tokens", 0) or 0),
        **(constraint.fields() if constraint is not None else {}),
    )
    try:
        params.validate(vocab_size or None)
    except ValueError as e:  # its message starts with the engine's field name
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param_names("prompt", constraint=constraint).get(name, name)) from None
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
    cached_tokens: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    accepted_tokens: int = 0
    accepted_suffix: int = 0
    budget_sum: int = 0
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    error: str | None = None
    error_status: int = 400
    error_param: str | None = None
    prompt_logprobs: list[tuple[str, float | None, list[tuple[str, float]] | None]] | None = None

    def add(self, out: TextOut) -> None:
        self.text += out.text
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.verify_steps = max(self.verify_steps, out.spec_verify_steps)
        self.plain_steps = max(self.plain_steps, out.spec_plain_steps)
        self.accepted_tokens = max(self.accepted_tokens, out.spec_accepted_tokens)
        self.accepted_suffix = max(self.accepted_suffix, out.spec_accepted_suffix)
        self.budget_sum = max(self.budget_sum, out.spec_budget_sum)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            if out.error is not None:
                self.error, self.error_status, self.error_param = out.error, out.error_status, out.error_param


def usage_of(choices: list[ChoiceAccum], prompt_tokens: int, choices_per_prompt: int | None = None) -> UsageInfo:
    """Usage of one response. ``choices`` come ``choices_per_prompt`` (``n``) per prompt, prompt after prompt
    (None: all share one prompt); a prompt counts once, with the most cached tokens any of its choices had."""
    completion = sum(c.completion_tokens for c in choices)
    per = choices_per_prompt or max(len(choices), 1)
    cached = sum(max(c.cached_tokens for c in choices[i:i + per]) for i in range(0, len(choices), per))
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def spec_of(choices: list[ChoiceAccum]) -> SpecStats:
    return SpecStats.of(sum(c.verify_steps for c in choices), sum(c.accepted_tokens for c in choices),
                        sum(c.budget_sum for c in choices), sum(c.accepted_suffix for c in choices),
                        sum(c.plain_steps for c in choices))


def raise_choice_error(choices: list[ChoiceAccum], names: dict[str, str] | None = None) -> None:
    """The first choice error as the APIError (``names``: as ``engine_error``'s)."""
    for c in choices:
        if c.error is not None:
            raise engine_error(TextOut("", "", [], finished=True, error=c.error, error_status=c.error_status,
                                       error_param=c.error_param), names)


def sse(obj: BaseModel | dict) -> str:
    data = obj if isinstance(obj, dict) else obj.model_dump(exclude_none=True)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Generation:
    """A started group of requests: ``async for idx, out in run`` yields their outputs in arrival order (the
    first one already received); ``async with run`` closes the engine stream and the disconnect watcher on
    the way out, however the handler leaves. ``names``: the API's names of the engine's fields (``param_names``),
    for the ``param`` of an error (``error``)."""

    def __init__(self, gen: AsyncIterator[tuple[int, TextOut]], first: tuple[int, TextOut],
                 watcher: asyncio.Task, names: dict[str, str] | None = None) -> None:
        self._gen, self._first, self._watcher = gen, first, watcher
        self._pending: tuple[int, TextOut] | None = first
        self.names = names

    def error(self, out: TextOut) -> APIError:
        """The APIError of an output that carries an error (an SSE error event when streaming)."""
        return engine_error(out, self.names)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, TextOut]:
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        return await self._gen.__anext__()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self._gen.aclose()  # type: ignore[attr-defined]
        finally:
            await cancel_task(self._watcher)

    async def collect(self, n: int) -> list[ChoiceAccum]:
        """Every output of ``n`` choices (non-streaming); the first choice error becomes the APIError."""
        acc = [ChoiceAccum() for _ in range(n)]
        async with self:
            async for idx, out in self:
                acc[idx].add(out)
        raise_choice_error(acc, self.names)
        return acc


async def start_generation(request: Request, tm: TokenizerManager, group: list[tuple[GenerateReq, DetokenizeReq]],
                           names: dict[str, str] | None = None) -> Generation:
    """Submit ``group``, watch the client for a disconnect (which aborts every request of the group), and wait
    for the first output so that an immediate rejection is an HTTP error rather than a stream. ``names``: the
    API's names of the engine's fields (``param_names``): an engine refusal is a 400 naming the API's field.

    The serving check is repeated here, with no await between it and the submission: a request admitted before
    a SIGTERM but still being prepared (templating, image decoding) when the drain starts gets the drain's 503
    with Retry-After, never an internal error, and a submitted request is in ``tm.states``, which the drain
    waits for."""
    check_serving(tm)
    gen = tm.generate(group)
    watcher = asyncio.create_task(watch_disconnect(request, tm, [g[0].rid for g in group]))
    try:
        first = await first_output(gen, names)
    except BaseException:
        await cancel_task(watcher)
        raise
    return Generation(gen, first, watcher, names)


async def first_output(gen: AsyncIterator[tuple[int, TextOut]], names: dict[str, str] | None = None
                       ) -> tuple[int, TextOut]:
    """Wait for the first output so that an immediate rejection becomes an HTTP error, not a stream."""
    idx, out = await gen.__anext__()
    if out.finished and out.error is not None:
        await gen.aclose()
        raise engine_error(out, names)
    return idx, out


async def cancel_task(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
