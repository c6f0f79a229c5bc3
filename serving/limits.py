"""What one request may ask of the server, each refused with its 4xx before any work
(`tercel serve` flags; docs/serving.md, "Limits"). Every limit here keeps one client from
costing the others: the event loop, the engine thread and memory are shared.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from serving.errors import error_body
from serving.protocol import APIError, bad

MiB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * MiB    # a larger body is a 413 before it is read (parsing holds the loop)
    max_stop: int = 16               # stop strings per request: each is searched for every token
    max_stop_chars: int = 256        # characters per stop string
    stream_buffer: int = 64          # outputs a stream holds unread before its client is dropped
    send_timeout_s: float = 30.0     # an SSE write blocked this long drops the client and aborts

    def __post_init__(self):
        for name in ("max_body_bytes", "max_stop", "max_stop_chars", "stream_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.send_timeout_s > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {self.send_timeout_s}")

    def check_stop(self, stop: tuple[str, ...]) -> None:
        if len(stop) > self.max_stop:
            raise bad("stop", f"'stop' has {len(stop)} strings; this server allows {self.max_stop} (--max-stop)")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise bad("stop", f"a 'stop' string has {longest} characters; this server allows "
                              f"{self.max_stop_chars} (--max-stop-chars)")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413, by its Content-Length before a byte
    is read, or as soon as a chunked body passes the limit. The body is read here whole (FastAPI
    reads it whole too) and handed to the app as one message. The connection stays open: uvicorn
    discards the rest of a refused body, so the client, still sending, then reads its 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.limit:
            return await _send_413(send, self.limit, scope.get("path", ""))
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":     # the client left while sending
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _send_413(send, self.limit, scope.get("path", ""))
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive):
    """A receive that gives the buffered body once, then the client's own messages (disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send, limit: int, path: str) -> None:
    body = json.dumps(error_body(path, too_large(limit))).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
