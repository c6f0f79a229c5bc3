"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A create runs as the chat route runs its request, with that route's parts: the Responses body
becomes a chat request (convert.py), which the chat route's field checks, parser and early
refusals (model, stop strings, context), tokenization and `Routes.start` (constraints,
speculation, the queue) take as they take their own; each refusal is re-named for the
Responses field at fault. The one choice's stream is then rendered as Responses output
(render.py), streamed as named SSE events or returned whole, and stored when asked.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from serving.bridge import RequestFailed, RequestStream
from serving.disconnect import until_disconnected
from serving.errors import engine_unavailable, request_failed, stream_error
from serving.protocol import APIError, ParsedRequest, bad
from serving.responses.convert import Turn, renamed, turn
from serving.responses.policy import check_fields
from serving.responses.render import OutputItems, ResponseHead, failed_body, final_body, output_messages, settings
from serving.responses.schemas import ResponsesRequest
from serving.responses.store import ResponseStore, StoredResponse
from serving.streaming import Reply


class ResponsesRoutes:
    def __init__(self, routes, store: ResponseStore):
        """`routes`: the app's serving/app.py:Routes, whose chat parts these use."""
        self.routes, self.store = routes, store

    async def create(self, body: ResponsesRequest, request: Request):
        check_fields(body)
        history = self._history(body.previous_response_id)
        try:
            asked = turn(body, history)
            req = self.routes.parsed_chat(asked.chat)     # the chat route's checks and parse, reasoning's too
        except APIError as e:
            raise renamed(e) from None
        return await until_disconnected(request, self._create(body, asked, req))

    async def get(self, response_id: str):
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id, None)
        return stored.body

    async def delete(self, response_id: str):
        if not self.store.delete(response_id):
            raise not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    def _history(self, previous_id: str | None) -> tuple[dict, ...]:
        if previous_id is None:
            return ()
        stored = self.store.get(previous_id)
        if stored is None:
            raise not_found(previous_id, "previous_response_id")
        return stored.conversation

    async def _create(self, body: ResponsesRequest, asked: Turn, req: ParsedRequest):
        routes = self.routes
        try:
            ids = await routes.chat_ids(req, asked.chat.chat_template_kwargs)     # off the event loop
            reply, streams = await routes.start(req, [ids], chat=True)
        except APIError as e:
            raise renamed(e) from None
        run = Run(self, body, asked, reply, streams[0],
                  ResponseHead(f"resp_{uuid.uuid4().hex}", int(time.time()), reply.model,
                               settings(body, req.params, body.previous_response_id is not None)))
        if body.stream:
            return EventSourceResponse(run.events(), ping=15, send_timeout=routes.config.limits.send_timeout_s)
        return await run.whole()


class Run:
    """One response under way: its stream, the items it builds, and what is stored at its end."""

    def __init__(self, owner: ResponsesRoutes, body: ResponsesRequest, asked: Turn, reply: Reply,
                 stream: RequestStream, head: ResponseHead):
        self.owner, self.body, self.asked, self.stream, self.head = owner, body, asked, stream, head
        self.deltas = reply.deltas(0)
        self.reasoning = reply.reasoning
        self.items = OutputItems()

    async def whole(self) -> dict:
        """The finished response object (refusals and failures as the chat route answers them)."""
        out = None
        try:
            async for out in self.stream:
                for entry in self.deltas.entries(out):
                    self.items.feed(entry)
        except ValueError as e:          # refused by the engine after all
            raise bad(None, str(e)) from None
        except RequestFailed as e:       # failed alone: its own 400, or a 500 that names no internals
            raise request_failed(e) from None
        except RuntimeError as e:        # engine failure or shutdown: a 503
            raise engine_unavailable(e) from None
        finally:
            self.stream.cancel()
        self.items.finish(out.finish_reason == "stop")
        return self._finished(out)

    async def events(self) -> AsyncIterator[dict]:
        """The named SSE events of a streamed response; a failure once under way ends it with
        `response.failed` (no exception text, as the chat route's error event)."""
        numbers = itertools.count()

        def sse(event: dict) -> dict:
            return {"event": event["type"], "data": json.dumps({**event, "sequence_number": next(numbers)},
                                                               ensure_ascii=False)}

        started = self.head.body("in_progress", [])
        yield sse({"type": "response.created", "response": started})
        yield sse({"type": "response.in_progress", "response": started})
        try:
            async for out in self.stream:
                for entry in self.deltas.entries(out):
                    for event in self.items.feed(entry):
                        yield sse(event)
                if out.finished:
                    for event in self.items.finish(out.finish_reason == "stop"):
                        yield sse(event)
                    body = self._finished(out)
                    yield sse({"type": f"response.{body['status']}", "response": body})
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - the client gets it as the response's error
            yield sse({"type": "response.failed", "response": failed_body(self.head, self.items, stream_error(e))})
        finally:   # normal end, client disconnect or error: free the engine's blocks
            self.stream.cancel()

    def _finished(self, out) -> dict:
        reasoning_tokens = self.reasoning.tokens(out.token_ids) if self.reasoning is not None else 0
        body = final_body(self.head, self.items, out, self.stream.num_prompt_tokens, reasoning_tokens,
                          int(time.time()))
        if self.body.store is not False:
            self.owner.store.put(self.head.id, StoredResponse(
                body, self.asked.conversation + output_messages(self.items.items)))
        return body


def not_found(response_id: str, param: str | None) -> APIError:
    what = "previous response" if param else "response"
    return APIError(404, f"no stored {what} with id {response_id[:64]!r} (responses are kept in this server's "
                         f"memory, for a while: docs/serving.md, \"Responses API\")", param=param,
                    type_="invalid_request_error", code="response_not_found")
