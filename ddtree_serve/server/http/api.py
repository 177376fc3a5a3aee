"""The HTTP front end: a FastAPI app built by ``create_app`` (no module-level app or state).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic Messages) and
POST /v1/responses (OpenAI Responses; ddtree_serve/server/http/agent_routes.py), POST /tokenize and /detokenize
(ddtree_serve/server/http/tokenize_routes.py), GET /v1/models, GET /health, GET /metrics,
GET /server_info and /get_server_info (every setting, the API key withheld), GET /model_info and
/get_model_info, GET /version (ddtree_serve/server/http/info_routes.py: SGLang's shapes, for SGLang routers), and the
OpenAPI spec at GET /openapi.json (browsable at /docs), whose request bodies are the pydantic models of
ddtree_serve/server/http/protocol.py. With an API key, every /v1 route needs ``Authorization: Bearer <key>`` (401 otherwise);
/health, /metrics and the spec stay open. Every error has the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` (validation errors are 400, not FastAPI's 422); clients
never see a stack trace. Request bodies over ``max_request_body_bytes`` get 413 before they are parsed, and
a body is read as JSON whatever its Content-Type says (as OpenAI's API does).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_serve.server.config import ServerConfig
from ddtree_serve.server.http.agent_routes import add_agent_routes
from ddtree_serve.server.http.body_limit import BodyGuard
from ddtree_serve.server.http.errors import APIError
from ddtree_serve.server.http.info_routes import add_info_routes
from ddtree_serve.server.http.openapi import openapi_spec
from ddtree_serve.server.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    error_body,
)
from ddtree_serve.server.http.protocol_messages import anthropic_error
from ddtree_serve.server.http.serving_chat import ChatHandler
from ddtree_serve.server.http.serving_common import check_serving, validation_error
from ddtree_serve.server.http.serving_completion import CompletionHandler
from ddtree_serve.server.http.tokenize_routes import add_tokenize_routes
from ddtree_serve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def served_model_name(config: ServerConfig) -> str:
    return config.model.served_model_name or config.model.model_path


def _responses(ok: type) -> dict:
    """OpenAPI responses of a generation route: the body model, and every error in the OpenAI shape."""
    errors = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model", 413: "body too large",
              503: "starting, failed, or queue full (Retry-After)"}
    return {200: {"model": ok, "description": "the completion (JSON), or server-sent events when streaming"},
            **{code: {"model": ErrorResponse, "description": d} for code, d in errors.items()}}


def create_app(config: ServerConfig, tm: TokenizerManager) -> FastAPI:
    served = served_model_name(config)
    chat = ChatHandler(config, tm, served, clamp=config.server.allow_auto_truncate)
    completion = CompletionHandler(config, tm, served)
    api_key = config.server.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="ddtree-serve", summary="OpenAI-compatible server with DFlash + DDTree speculative decoding",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.tokenizer_manager = tm
    app.openapi = lambda: openapi_spec(app)  # type: ignore[method-assign] - no 422 (ddtree_serve/server/http/openapi.py)
    app.add_middleware(BodyGuard, max_bytes=config.server.max_request_body_bytes)

    @app.middleware("http")
    async def auth(request: Request, call_next):  # noqa: ANN202 - starlette middleware signature
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                body = (anthropic_error(401, "invalid or missing API key") if request.url.path == "/v1/messages"
                        else error_body(401, "invalid or missing API key", code="invalid_api_key"))
                return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        check_serving(tm)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_info_routes(app, config)  # /server_info, /model_info, /version (+ SGLang's old /get_* names)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=served, max_model_len=tm.max_context_len or None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions", response_model=None, responses=_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions; ``stream: true`` answers with server-sent events of chunks."""
        return await chat.handle(request, body)

    @app.post("/v1/completions", response_model=None, responses=_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) completions over text or token-id prompts."""
        return await completion.handle(request, body)

    add_agent_routes(app, config, tm, served)  # /v1/messages (Anthropic), /v1/responses (OpenAI Responses)
    add_tokenize_routes(app, tm, served)  # /tokenize, /detokenize
    return app
