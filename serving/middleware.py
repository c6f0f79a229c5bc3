"""The outermost layer of the app: request ids, and no exception ever reaching uvicorn.

Starlette's own last-resort handler answers 500 but then re-raises the exception, and
uvicorn, seeing a response already sent, closes the connection: the client's next request on
that keep-alive connection fails. Here an unexpected exception becomes a 500 with the OpenAI
error body (Anthropic's on the Messages routes), logged with the request's id, and the ASGI
call returns normally.
"""
from __future__ import annotations

import json
import logging
import uuid

from serving.errors import error_body
from serving.protocol import APIError

log = logging.getLogger("tercel.serve")
REQUEST_ID = b"x-request-id"


class ServerErrors:
    """ASGI middleware: an `x-request-id` on every response (the client's own if it sent
    one), and a 500 error body (OpenAI's shape, Anthropic's on the Messages routes) for any exception
    the routes let escape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = _request_id(scope)
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:   # noqa: BLE001 - the last resort: logged here, answered in the route's shape
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
            if not started:   # a stream already under way ends short; its client sees no [DONE]
                await _send_500(send, rid, scope.get("path", ""))


def _request_id(scope) -> str:
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID:
            return value.decode("latin-1")[:128]
    return uuid.uuid4().hex


async def _send_500(send, rid: str, path: str) -> None:
    error = APIError(500, f"internal server error (request id {rid}); the server logged it", type_="server_error",
                     code="internal_error")
    body = json.dumps(error_body(path, error)).encode()
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (REQUEST_ID, rid.encode())]})
    await send({"type": "http.response.body", "body": body})
