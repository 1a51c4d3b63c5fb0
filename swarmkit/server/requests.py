"""Reading a request: its JSON body and its bearer token, with clear 400s."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from swarmkit.errors import ApiError


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or 400 with what is wrong."""
    raw = await request.body()
    if not raw:
        raise ApiError(400, "empty request body; send a JSON object", "invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


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
