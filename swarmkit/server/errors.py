"""OpenAI-style JSON errors: ``{"error": {"message", "type", "code", "param"}}``.

Every 4xx/5xx the server sends has this shape, so the official ``openai`` SDK
raises its usual typed exceptions with a readable message.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

#: HTTP status -> OpenAI error ``type``
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "server_busy",
}


class ApiError(Exception):
    """An error answer: raise it anywhere in an endpoint.

    :param status: HTTP status code.
    :param message: what went wrong and what to do instead.
    :param code: a stable machine-readable code (``episode_not_found``...).
    :param param: the offending request field, if any.
    :param headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The JSON payload of an error answer."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "code": code,
            "param": param,
        }
    }


def error_response(
    status: int, message: str, code: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def busy(message: str, retry_after: float = 1.0, code: str = "server_busy") -> ApiError:
    """A 503 "retry later" answer that the client SDK (and the openai SDK) honour."""
    return ApiError(503, message, code, headers={"Retry-After": f"{max(1, round(retry_after))}"})


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.code, param=exc.param, headers=exc.headers)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    messages = {
        404: f"no route {request.method} {request.url.path}; see docs/server_api.md",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    code = {404: "route_not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(
        exc.status_code, messages.get(exc.status_code, str(exc.detail)), code, headers=dict(exc.headers or {})
    )


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    import logging

    logging.getLogger("swarmkit.server").exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", "internal_error")


EXCEPTION_HANDLERS = {
    ApiError: api_error_handler,
    HTTPException: http_error_handler,
    Exception: unexpected_error_handler,
}
