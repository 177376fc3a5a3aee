"""The agent API routes: POST /v1/messages (Anthropic Messages, ddtree_serve/server/http/serving_messages.py) and POST
/v1/responses (OpenAI Responses, ddtree_serve/server/http/serving_responses.py).

/v1/messages answers every error in Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``
(its routes use ``AnthropicRoute``, which reshapes the APIErrors and validation errors raised while handling
them); /v1/responses keeps OpenAI's shape. Both need the API key like every /v1 route (``Authorization:
Bearer`` or Anthropic's ``x-api-key``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.protocol import ErrorResponse
from ddtree_serve.server.http.protocol_messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from ddtree_serve.server.http.protocol_responses import ResponsesRequest
from ddtree_serve.server.http.serving_common import validation_error
from ddtree_serve.server.http.serving_messages import MessagesHandler, messages_error
from ddtree_serve.server.http.serving_responses import ResponsesHandler
from ddtree_serve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


class AnthropicRoute(APIRoute):
    """A route whose errors have Anthropic's shape (the status codes are the OpenAI routes')."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                response = messages_error(e.status, e.message)
                response.headers.update(e.headers or {})
                return response
            except RequestValidationError as e:
                err = validation_error(list(e.errors()))
                return messages_error(err.status, err.message)
            except StarletteHTTPException as e:  # e.g. a body that is not UTF-8
                return messages_error(e.status_code, str(e.detail))
            except Exception:  # noqa: BLE001 - a stack trace is never a client's answer
                logger.exception("unhandled error on %s", request.url.path)
                return messages_error(500, "internal server error")

        return handle


def add_agent_routes(app: FastAPI, config: ServerConfig, tm: TokenizerManager, served: str) -> None:
    messages = MessagesHandler(config, tm, served)
    responses = ResponsesHandler(config, tm, served)
    router = APIRouter(route_class=AnthropicRoute)
    errors = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model", 413: "body too large",
              503: "starting, failed, or queue full (Retry-After)"}

    @router.post("/v1/messages", response_model=None, responses={
        200: {"description": "the message (JSON), or Anthropic's server-sent events when streaming"},
        **{code: {"description": f"{d}, in Anthropic's error shape"} for code, d in errors.items()}})
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        """Anthropic Messages (docs/API.md); ``stream: true`` answers with Anthropic's event stream."""
        return await messages.handle(request, body)

    @router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses={
        **{code: {"description": f"{d}, in Anthropic's error shape"} for code, d in errors.items() if code != 503}})
    async def count_tokens(body: CountTokensRequest) -> Response:
        """Anthropic's token count of a Messages request: the prompt /v1/messages would send (Claude Code
        calls it); no generation."""
        return await messages.count_tokens(body)

    app.include_router(router)

    @app.post("/v1/responses", response_model=None, responses={
        200: {"description": "the response (JSON), or Responses server-sent events when streaming"},
        **{code: {"model": ErrorResponse, "description": d} for code, d in errors.items()}})
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses, stateless (docs/API.md); ``stream: true`` answers with Responses events."""
        return await responses.handle(request, body)
