"""JSON errors in the shape of the protocol that was called.

Every 4xx/5xx has OpenAI's shape ``{"error": {"message", "type", "code", "param"}}``,
so the ``openai`` SDK raises its usual typed exceptions with a readable message;
under ``/v1/messages`` it has Anthropic's ``{"type": "error", "error": {"type",
"message"}}``, so the ``anthropic`` SDK does too. The layers below raise
:class:`swarmkit.errors.ApiError`; the handlers here answer it.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkit.errors import ApiError, EngineError
from swarmkit.swarm.gateway import engine_error

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


#: HTTP status -> Anthropic error ``type``
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """The JSON payload of an error answer under ``/v1/messages``."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


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


def protocol_error(request: Request, status: int, message: str, code: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer in the shape of the protocol ``request`` speaks."""
    if _is_anthropic(request):
        if param and param not in message:
            message = f"{param}: {message}"
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, code, param=param, headers=headers)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return protocol_error(request, exc.status, exc.message, exc.code, param=exc.param, headers=exc.headers)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path
    hint = ("; the SDK added /v1 to a base_url that already ends in /v1: give the Anthropic SDK the server's "
            "root (registration answers it as anthropic_base_url)") if path.startswith("/v1/v1/") else ""
    messages = {
        404: f"no route {request.method} {path}{hint}; see docs/server_api.md",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    code = {404: "route_not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return protocol_error(request, exc.status_code, messages.get(exc.status_code, str(exc.detail)), code,
                          headers=dict(exc.headers or {}))


#: how many unexpected errors of each kind (exception type and where it was raised) were logged
_SEEN_ERRORS: dict[tuple[str, str, int], int] = {}


def _error_site(exc: BaseException) -> tuple[str, str, int]:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ("?", 0)
    return type(exc).__name__, where[0], where[1]


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    """A 500 that names an incident, not the exception: its text can hold prompts, paths or keys.
    The server log has the traceback once per kind of error, then one line per repeat."""
    incident = secrets.token_hex(4)
    log = logging.getLogger("swarmkit.server")
    site = _error_site(exc)
    seen = _SEEN_ERRORS.get(site, 0)
    if len(_SEEN_ERRORS) < 1000 or seen:
        _SEEN_ERRORS[site] = seen + 1
    if seen == 0:
        log.error("incident %s: unhandled error in %s %s", incident, request.method, request.url.path, exc_info=exc)
    else:
        log.error("incident %s: unhandled %s in %s %s (seen %d times; traceback logged the first time)",
                  incident, site[0], request.method, request.url.path, seen + 1)
    return protocol_error(request, 500, f"internal server error (incident {incident}); the server log has the "
                          "details", "internal_error")


async def engine_error_handler(request: Request, exc: Exception) -> Response:
    """An engine that failed on a request (a stream's first chunk, where the gateway does not answer): 500, or
    503 when the engine is dead (:func:`swarmkit.swarm.gateway.engine_error`)."""
    assert isinstance(exc, EngineError)
    err = engine_error(exc)
    return protocol_error(request, err.status, err.message, err.code, headers=err.headers)


EXCEPTION_HANDLERS = {
    ApiError: api_error_handler,
    EngineError: engine_error_handler,
    HTTPException: http_error_handler,
    Exception: unexpected_error_handler,
}
