"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response

# status -> OpenAI's error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500
                          else "internal_server_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def error_response(err: OpenAIError) -> Response:
    from starlette.responses import Response

    return Response(err.json_bytes(), status_code=err.status, headers=err.headers,
                    media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Every error a FastAPI app can raise leaves as OpenAI-shaped JSON."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(OpenAIError)
    async def _openai(_request: Request, err: OpenAIError) -> Response:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, err: HTTPException) -> Response:
        return error_response(OpenAIError(err.status_code, str(err.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, err: RequestValidationError) -> Response:
        return error_response(OpenAIError(400, str(err.errors()[0].get("msg"))))


# On a 5xx a router retries a worker's failure elsewhere; with this header the worker says
# the request itself caused it (its own settings failed the engine), so the router answers
# it as it is instead.
NO_RETRY_HEADER = "X-Baton-No-Retry"
