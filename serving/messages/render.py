"""A Messages reply from its request stream: Anthropic's server-sent events, or the whole
message. Both are driven by the chat route's deltas (serving/deltas.py:ChoiceDeltas: text,
the call parser's tool calls, and `reasoning_content` where a reasoning parser adds it), so a
streamed reply, assembled, is the whole one.

The events, each with its `event:` name (the SDK reads nothing else):
    message_start         the message with no content, its usage so far
    content_block_start   a block opens: text, thinking (its signature empty) or tool_use (input {})
    content_block_delta   text_delta, thinking_delta, or input_json_delta (the arguments as written)
    content_block_stop    a block closes (the next opens, or the reply ends)
    message_delta         stop_reason, stop_sequence, the usage
    message_stop
A request that fails once under way sends one `error` event (Anthropic's error body) instead
of the rest.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serving.bridge import RequestFailed, RequestStream
from serving.deltas import ChoiceDeltas
from serving.errors import stream_failure
from serving.messages.errors import anthropic_body
from serving.protocol import tercel_stats
from serving.streaming import Reply
from spec.request import RequestOutput


@dataclass(frozen=True)
class MessageReply:
    """One Messages reply under way: what its events and body say besides the outputs."""
    id: str                          # msg_...
    chat: Reply                      # the chat route's description of it: model, tools' format, reasoning parser

    @property
    def model(self) -> str:
        return self.chat.model

    def deltas(self) -> ChoiceDeltas:
        return self.chat.deltas(0)


@dataclass
class ContentBlocks:
    """The content blocks of one reply, as its chat deltas come: the events that stream them,
    and the blocks the whole message holds. One block is open at a time, as Anthropic's are."""
    blocks: list[dict] = field(default_factory=list)
    _arguments: dict[int, str] = field(default_factory=dict)    # tool_use block -> its input's JSON text
    _calls: dict[int, int] = field(default_factory=dict)        # the deltas' call index -> its block
    _open: bool = False

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def close(self) -> list[dict]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def content(self) -> list[dict]:
        """The whole blocks: a tool_use's input parsed (or {} where max_tokens cut it)."""
        return [{**b, "input": _input(self._arguments[i])} if b["type"] == "tool_use" else b
                for i, b in enumerate(self.blocks)]

    def _text(self, kind: str, text: str) -> list[dict]:
        opened = self._open and self.blocks[-1]["type"] == kind
        events = [] if opened else self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking"
                                                                              else {})})
        self.blocks[-1] = {**self.blocks[-1], kind: self.blocks[-1][kind] + text}
        return events + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _call(self, call: dict) -> list[dict]:
        if "id" in call:         # a call opens: its index, id and name (serving/deltas.py:tool_deltas)
            events = self._start({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                  "input": {}})
            self._calls[call["index"]] = len(self.blocks) - 1
            self._arguments[len(self.blocks) - 1] = ""
            return events
        piece, at = call["function"]["arguments"], self._calls[call["index"]]
        self._arguments[at] += piece
        return [self._delta({"type": "input_json_delta", "partial_json": piece})] if piece else []

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.blocks.append(block)
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(out: RequestOutput, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine says which stop string ended the text
    (`RequestOutput.stop_string`); a reply that called tools and ended by itself is "tool_use"."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if out.stop_string is not None:
        return "stop_sequence", out.stop_string
    return "end_turn", None


def usage(prompt_tokens: int, out: RequestOutput) -> dict:
    """Anthropic's counts: the prompt's tokens read from the prefix cache apart from the rest."""
    cached = min(out.num_cached_tokens, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": len(out.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message(reply: MessageReply, content: list[dict], stop: tuple[str | None, str | None], counts: dict) -> dict:
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": counts}


async def whole_message(reply: MessageReply, stream: RequestStream) -> dict:
    """Wait for the reply to finish; the message body (APIError for a request that failed)."""
    choice, blocks, out = reply.deltas(), ContentBlocks(), None
    try:
        async for out in stream:
            for entry in choice.entries(out):
                blocks.feed(entry["delta"])
    except (ValueError, RuntimeError, RequestFailed) as e:    # as the chat route's full_reply answers them
        raise stream_failure(e) from None
    finally:
        stream.cancel()
    body = message(reply, blocks.content(), stop_reason(out, choice.called), usage(stream.num_prompt_tokens, out))
    return {**body, "tercel": tercel_stats([out])}


async def message_events(reply: MessageReply, stream: RequestStream) -> AsyncIterator[dict]:
    """The reply's server-sent events, as its outputs come."""
    choice, blocks, started = reply.deltas(), ContentBlocks(), False
    try:
        async for out in stream:
            if not started:     # at the first output: its usage counts the prefix cache's tokens
                started = True
                start = message(reply, [], (None, None), usage(stream.num_prompt_tokens, out))
                yield _event({"type": "message_start", "message": start})
            for entry in choice.entries(out):
                for event in blocks.feed(entry["delta"]):
                    yield _event(event)
            if out.finished:
                for event in blocks.close():
                    yield _event(event)
                reason, sequence = stop_reason(out, choice.called)
                yield _event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": usage(stream.num_prompt_tokens, out)})
                yield _event({"type": "message_stop"})
    except Exception as e:   # noqa: BLE001 - forwarded to the client as an error event
        yield _event(anthropic_body(stream_failure(e)))
    finally:     # normal end, client disconnect (CancelledError) or error: free the engine's blocks
        stream.cancel()


def _event(data: dict) -> dict:
    return {"event": data["type"], "data": json.dumps(data, ensure_ascii=False)}
