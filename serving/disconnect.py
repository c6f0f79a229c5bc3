"""A request's work raced against its client: a client that leaves before the reply starts
(a non-streamed reply never starts until the end) cancels the work, and the cancellation
aborts its engine requests (serving/streaming.py frees them in `finally`). A streamed reply
is handed back at once; sse-starlette watches its client from then on."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request, Response

CLIENT_CLOSED = 499   # nginx's status for a client that closed the connection; nobody reads it


async def until_disconnected(request: Request, work):
    """The result of the coroutine `work`, or (the client gone first) a 499 once it is cancelled."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED)


async def _disconnected(request: Request) -> None:
    # The body is already read (FastAPI parsed it): the next message is the client leaving.
    while (await request.receive())["type"] != "http.disconnect":
        pass
