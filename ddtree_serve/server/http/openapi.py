"""The OpenAPI spec served at /openapi.json: FastAPI's, without the 422 responses it adds to every route with
a body (this server answers a body that fails validation with a 400 in OpenAI's error shape, never a 422).

The request schemas are the pydantic models of ddtree_serve/server/http/protocol*.py and tokenize_routes.py, which publish
the constraints validation and the handlers enforce (bounds, enums, required fields, refused fields as null,
and the cross-field rules as JSON Schema if/then/not: ddtree_serve/server/http/protocol_rules.py), so a client generated
from the spec sends bodies the server accepts. Rules that depend on the server's settings (``tools`` needs
``--tool-call-parser``; prompt length), on the tokenizer, or that JSON Schema cannot state (a grammar's
syntax, a reference between fields, an order between list items) stay out: docs/API.md lists them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def openapi_spec(app: FastAPI) -> dict[str, Any]:
    """The app's spec (built once, then cached on the app as FastAPI does) with no 422 response."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for ops in spec.get("paths", {}).values():
            for op in ops.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
        schemas = spec.get("components", {}).get("schemas", {})
        for name in _FASTAPI_VALIDATION_SCHEMAS:
            schemas.pop(name, None)
        app.openapi_schema = spec
    return app.openapi_schema
