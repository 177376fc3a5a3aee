"""Run an internal chat-completions request for the agent APIs (/v1/messages, /v1/responses).

Both APIs are translations: their handlers build a ``ChatCompletionRequest`` and run it through the chat
handler (ddtree_serve/server/http/serving_chat.py) unchanged, so templates, tool parsers, reasoning parsers, structured output and
sampling are the same code, and the same conversation gives the same prompt tokens and the same greedy text.
The chat handler's output (its JSON, or its stream of chunks) is then reshaped by the API's own handler.

``ChatTap`` is a view of the TokenizerManager for one request that records the engine outputs as they pass:
the first one (the prompt and cached token counts, known before any text is streamed) and the finishing one
of each choice (``matched_stop``: which stop sequence ended the text, which chat completions do not report).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ChatCompletionRequest
from ddtree_serve.server.http.serving_chat import ChatHandler
from ddtree_serve.server.http.serving_common import validation_error
from ddtree_serve.server.io_struct import DetokenizeReq, GenerateReq, TextOut
from ddtree_serve.server.tokenizer_manager import TokenizerManager


class ChatTap:
    """A TokenizerManager for one HTTP request that records the outputs of its generation (every other
    attribute is the real manager's)."""

    def __init__(self, tm: TokenizerManager) -> None:
        self._tm = tm
        self.first: TextOut | None = None
        self.finished: dict[int, TextOut] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tm, name)

    async def generate(self, reqs: list[tuple[GenerateReq, DetokenizeReq]]) -> AsyncIterator[tuple[int, TextOut]]:
        gen = self._tm.generate(reqs)
        try:
            async for idx, out in gen:
                if self.first is None:
                    self.first = out
                if out.finished:
                    self.finished[idx] = out
                yield idx, out
        finally:
            await gen.aclose()  # type: ignore[attr-defined] - aborts what is still running

    @property
    def prompt_tokens(self) -> int:
        return self.first.prompt_tokens if self.first is not None else 0

    @property
    def cached_tokens(self) -> int:
        return max([o.cached_tokens for o in self.finished.values()] + [self.first.cached_tokens if self.first else 0])

    def matched_stop(self, idx: int = 0) -> str | int | None:
        out = self.finished.get(idx)
        return out.matched_stop if out is not None else None


def chat_request(body: dict[str, Any], param_names: dict[str, str] | None = None) -> ChatCompletionRequest:
    """Validate an internal chat request built by a translation; a failure is the 400 of its field, renamed
    to the client's API through ``param_names`` (chat field -> that API's field)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = validation_error(e.errors(include_url=False))
        if err.param and param_names and err.param in param_names:
            err.param = param_names[err.param]
            err.message = f"{err.param}: {err.message.split(': ', 1)[-1]}"
        raise err from None


class ChatRun:
    """One internal chat request run: ``json`` (not streaming) or ``chunks()`` (streaming)."""

    def __init__(self, tap: ChatTap, response: Response) -> None:
        self.tap, self._response = tap, response

    @property
    def json(self) -> dict[str, Any]:
        assert isinstance(self._response, JSONResponse)
        return json.loads(bytes(self._response.body))

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The chat stream's chunks as dicts (an error is ``{"error": {...}}``); closing this closes the run."""
        assert isinstance(self._response, StreamingResponse)
        body = self._response.body_iterator
        try:
            async for raw in body:
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                for line in text.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[6:])
        finally:
            await body.aclose()  # type: ignore[attr-defined]


async def run_chat(config: ServerConfig, tm: TokenizerManager, served: str, request: Request,
                   req: ChatCompletionRequest, param_names: dict[str, str] | None = None,
                   clamp: bool = True) -> ChatRun:
    """Run ``req`` through the chat handler (its APIErrors propagate: admission, template, length, grammar;
    their ``param`` renamed to the client's API through ``param_names``, as ``chat_request``'s). ``clamp``:
    a ``max_tokens`` beyond the room the context leaves is lowered to it (the agent APIs' rule)."""
    tap = ChatTap(tm)
    try:
        response = await ChatHandler(config, tap, served, clamp).handle(request, req)  # type: ignore[arg-type]
    except APIError as e:
        if e.param and param_names and e.param in param_names:
            e.param = param_names[e.param]
        raise
    return ChatRun(tap, response)


def check_refused(body: Any, fields: dict[str, str]) -> None:
    """400 naming the first of ``fields`` (field -> why) that the request sets: known fields this server cannot
    honour are refused, never ignored."""
    for name, why in fields.items():
        value = getattr(body, name, None)
        if value is not None and value is not False and value != [] and value != {}:
            raise APIError(400, f"{name} is not supported: {why}", param=name, code="unsupported_parameter")
