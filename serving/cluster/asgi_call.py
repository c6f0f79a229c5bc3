"""One HTTP request through an ASGI app in-process, with no server or socket: how a Ray Serve
replica (serving/cluster/replicas.py) runs the very app `tercel serve` serves (serving/app.py), routes,
errors and SSE included, for a request its ingress forwarded.

The hand-off types cross a Ray call, so they are small, frozen and picklable:
`ForwardedRequest` (ingress -> replica), then `ResponseStart` and body chunks (`bytes`) back,
or one `FullResponse` for calls that are not streamed (broadcasts: /metrics, /health).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

REPLICA_HEADER = b"x-tercel-replica"   # which replica answered: the tests and the bench read it
_APP_RETURNED = object()


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]    # as ASGI has them: lower-case names
    body: bytes
    prefix_key: str = ""       # what the prefix-affinity router matches (serving/cluster/prefix_index.py)


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    @property
    def is_stream(self) -> bool:
        return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)


@dataclass(frozen=True)
class FullResponse:
    replica: str
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


def _scope(req: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query, "root_path": "", "headers": list(req.headers),
            "client": ("127.0.0.1", 0), "server": ("tercel-replica", 80), "state": {}}


async def call_asgi(app, req: ForwardedRequest, extra_headers=()) -> AsyncIterator[ResponseStart | bytes]:
    """Run `req` through `app`: yields one ResponseStart, then the body in the chunks the app
    sent them (an SSE event each). Closing the iterator early (the client left, the call was
    cancelled) tells the app the client disconnected, so a stream cancels its engine requests."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive():
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(_scope(req), receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(_APP_RETURNED))
    ended = False
    try:
        while (msg := await sent.get()) is not _APP_RETURNED:
            if msg["type"] == "http.response.start":
                yield ResponseStart(msg["status"], tuple(msg.get("headers", ())) + tuple(extra_headers))
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    ended = True
                    return
        task.result()     # the app returned without finishing its reply: raise what it raised
        raise RuntimeError(f"{req.method} {req.path}: the app returned before its reply ended")
    finally:
        gone.set()
        if ended:         # the reply is out; let the app return by itself
            await asyncio.wait([task], timeout=5.0)
        if not task.done():
            task.cancel()   # the caller left: the handlers' cleanup cancels their engine requests


async def full_response(app, req: ForwardedRequest, replica: str) -> FullResponse:
    """The whole reply of a short request (not a stream)."""
    start, chunks = None, []
    async for item in call_asgi(app, req):
        if isinstance(item, ResponseStart):
            start = item
        else:
            chunks.append(item)
    return FullResponse(replica, start.status, start.headers, b"".join(chunks))
