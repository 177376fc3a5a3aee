"""The error every HTTP handler raises for a refused or failed request: an OpenAI error body with a status."""

from __future__ import annotations

from ddtree_serve.server.http.protocol_outputs import error_body


class APIError(Exception):
    """A request the server answers with ``status`` and OpenAI's error JSON (``param`` names the field)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)
