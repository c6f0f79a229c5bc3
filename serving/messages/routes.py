"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: a Messages body converted to a
chat request (convert.py) runs as /v1/chat/completions runs one (serving/app.py:Routes), and
its stream is rendered as Anthropic's (render.py). A refusal of the chat request is renamed
to the Messages fields (errors.py:renamed) and written in Anthropic's shape (serving/errors.py)."""
from __future__ import annotations

import uuid

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from serving.disconnect import until_disconnected
from serving.errors import unknown_model
from serving.messages.convert import chat_request
from serving.messages.errors import renamed
from serving.messages.render import MessageReply, message_events, whole_message
from serving.messages.schemas import CountTokensRequest, MessagesRequest
from serving.protocol import APIError, ParsedRequest, parse_chat


class MessagesRoutes:
    def __init__(self, routes):
        self.routes = routes     # serving/app.py:Routes, whose checks and engine access these share

    async def create(self, body: MessagesRequest, request: Request):
        try:
            chat = chat_request(body, budgets=self.routes.config.reasoning is not None)
            req = self.routes.parsed_chat(chat)
        except APIError as e:
            raise renamed(e) from None
        return await until_disconnected(request, self._create(req, chat.chat_template_kwargs))

    async def _create(self, req: ParsedRequest, template_kwargs: dict | None):
        try:
            ids = await self.routes.chat_ids(req, template_kwargs)
            reply, streams = await self.routes.start(req, [ids], chat=True)
        except APIError as e:
            raise renamed(e) from None
        message = MessageReply(f"msg_{uuid.uuid4().hex[:24]}", reply)
        if req.stream:
            return EventSourceResponse(message_events(message, streams[0]), ping=15,
                                       send_timeout=self.routes.config.limits.send_timeout_s)
        return await whole_message(message, streams[0])

    async def count_tokens(self, body: CountTokensRequest):
        """The prompt's tokens, as /v1/messages would send them (the tools and thinking switch included)."""
        routes = self.routes
        try:
            chat = chat_request(body)
            if chat.model not in routes.served:
                raise unknown_model(chat.model, routes.served.first)
            req = parse_chat(chat, routes.config.tool_format, routes.bridge.limits.max_model_len,
                             routes.config.reasoning)
        except APIError as e:
            raise renamed(e) from None
        return {"input_tokens": len(await routes.chat_ids(req, chat.chat_template_kwargs))}
