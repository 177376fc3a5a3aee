"""ASGI middleware in front of the routes: a request body larger than ``max_bytes`` gets 413 before any of it
is parsed (from Content-Length when sent, else counted while reading a chunked body), and a request body is
declared JSON for the route's parser whatever Content-Type the client sent (the API takes only JSON bodies;
``curl -d`` sends form encoding by default)."""

from __future__ import annotations

import json
from typing import Any

from ddtree_serve.server.http.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyGuard:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type",)]
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect the handlers watch for

        scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        payload = json.dumps(
            error_body(
                413,
                f"the request body exceeds max_request_body_bytes ({self.max_bytes})",
                code="request_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
