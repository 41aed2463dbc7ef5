"""The server's error type: an OpenAI-style error body (message, type, the request field at fault, code)
with its HTTP status, shared by the HTTP gate, the prompt preparation and the route handlers.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        elif self.status == 429:
            kind = "rate_limit_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
