"""Pure ASGI middleware of the swarm server."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkit.server.errors import anthropic_error_body, error_body, unexpected_error_handler


class BodySizeLimit:
    """Pure ASGI middleware: 413 for request bodies over ``max_bytes``.

    A declared ``Content-Length`` over the limit is refused before reading; a
    chunked body is counted as it arrives and refused once it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._refuse(send, 400, "invalid Content-Length header", "invalid_header", scope.get("path", ""))
                    return
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send, 413, self._message(declared), "body_too_large", scope.get("path", ""))
                return
            await self.app(scope, receive, send)
            return
        # no Content-Length: read and count the body, then replay it
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, 413, self._message(size), "body_too_large", scope.get("path", ""))
                return
            chunks.append(body)
            more = message.get("more_body", False)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    def _message(self, size: int) -> str:
        return f"request body of {size} bytes is over this server's limit of {self.max_bytes} bytes " \
               "(server.max_body_bytes)"

    async def _refuse(self, send: Send, status: int, message: str, code: str, path: str = "") -> None:
        body = anthropic_error_body(status, message) if path.startswith("/v1/messages") else \
            error_body(status, message, code)
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    queue = list(messages)

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


class UnexpectedErrors:
    """Pure ASGI middleware: an exception no route handled becomes a 500 naming an incident
    (:func:`~swarmkit.server.errors.unexpected_error_handler`), and goes no further: Starlette's
    outer error middleware would re-raise it to the ASGI server, which logs the whole traceback
    again for every such request."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the one place that turns the unexpected into a 500
            response = await unexpected_error_handler(Request(scope), exc)
            if not started:  # a response under way (a stream) cannot be replaced: it just ends
                await response(scope, receive, send)
