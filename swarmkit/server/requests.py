"""Reading a request: its JSON body and its bearer token, with clear 400s."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from swarmkit.errors import ApiError
from swarmkit.swarm.gateway import CALLER_GONE

#: the most digits an integer of a request may have (a 64-bit value has 20): larger ones overflow later
MAX_INT_DIGITS = 20


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or 400 with what is wrong.

    Refused here, before anything reads the body: integers longer than 20 digits, nesting
    deeper than Python's recursion limit, and strings with lone surrogates (``"\\ud800"``:
    valid JSON that no UTF-8 file, database or answer can hold).
    """
    raw = await request.body()
    CALLER_GONE.set(lambda: _disconnected(request))
    if not raw:
        raise ApiError(400, "empty request body; send a JSON object", "invalid_json")
    try:
        body = json.loads(raw, parse_int=_bounded_int)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if b"\\u" in raw and _has_lone_surrogate(body):
        raise ApiError(400, "malformed JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                       "which is not valid Unicode text", "invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def _has_lone_surrogate(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def bearer(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (or ``x-api-key``, Anthropic's header, or
    ``api-key``, Azure's), if any."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return request.headers.get("x-api-key") or request.headers.get("api-key") or None


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
