"""Replies built from request streams: the server-sent events of a streamed completion, and
the JSON body of one that is not. A reply has one RequestStream per choice (n per prompt,
prompts in order); choice i is stream i.

SSE format, as OpenAI's: one `data: {json}` event per chunk. A chat stream opens each choice
with a role delta; every text delta is a chunk; a choice ends with a chunk carrying its
finish_reason; `stream_options.include_usage` adds a last chunk with no choices and the
usage; the stream ends with `data: [DONE]`. A request that fails once its stream is under
way sends one error event instead of the rest, and no `[DONE]`.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serving.bridge import RequestFailed, RequestStream
from serving.errors import engine_unavailable, request_failed, stream_error
from serving.prediction import completion_tokens_details
from serving.protocol import bad, envelope, tercel_stats, usage
from serving.tools.formats import ToolFormat
from serving.tools.parser import Arguments, CallStart, Content, ToolCallParser, parse_reply
from spec.request import RequestOutput


@dataclass(frozen=True)
class Reply:
    """One response under way: what its bodies say besides the outputs."""
    id: str                 # chatcmpl-... or cmpl-...
    model: str              # the model name reported
    chat: bool              # a chat completion (messages, deltas) or a text completion
    n: int                  # choices per prompt (usage counts each prompt once)
    include_usage: bool     # streams only: a last chunk with the usage
    tools: ToolFormat | None = None   # chat with tools: tool calls are read out of the text in this format
    predicted: bool = False           # the request carried a prediction: the usage counts its tokens

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"data": json.dumps(envelope(self.chunk_object, self.id, self.model, choices, **extra),
                                   ensure_ascii=False)}

    def token_usage(self, streams: list[RequestStream], outs: list[RequestOutput]) -> dict:
        prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(1, self.n)   # each prompt once
        counts = usage(prompt_tokens, sum(len(o.token_ids) for o in outs))
        return {**counts, "completion_tokens_details": completion_tokens_details(outs)} if self.predicted else counts


async def full_reply(reply: Reply, streams: list[RequestStream]) -> dict:
    """Wait for every choice to finish; the chat.completion or text_completion body."""
    try:
        finals = await asyncio.gather(*(_last(s) for s in streams))
    except ValueError as e:          # refused by the engine after all
        raise bad(None, str(e)) from None
    except RequestFailed as e:       # failed alone: its own 400, or a 500 that names no internals
        raise request_failed(e) from None
    except RuntimeError as e:        # engine failure or shutdown: an OpenAI-shaped 503, not a bare 500
        raise engine_unavailable(e) from None
    finally:
        for s in streams:
            s.cancel()
    choices = [_choice(i, o, reply) for i, o in enumerate(finals)]
    return envelope("chat.completion" if reply.chat else "text_completion", reply.id, reply.model, choices,
                    usage=reply.token_usage(streams, finals), tercel=tercel_stats(finals))


async def sse_events(reply: Reply, streams: list[RequestStream]) -> AsyncIterator[dict]:
    """The events of a streamed reply, choices interleaved as their tokens come."""
    # Bounded: a client that stops reading stops the pumps, and each stream's own bound then
    # drops it (bridge.SlowReader) instead of memory growing with every step.
    merged: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    tasks = [asyncio.create_task(_pump(i, s, merged)) for i, s in enumerate(streams)]
    finals, open_streams = {}, len(streams)
    try:
        if reply.chat:
            for i in range(len(streams)):
                # null, not "", where a reply may hold only calls: clients accumulate content from it
                opening = {"role": "assistant", "content": None if reply.tools else ""}
                yield reply.chunk([{"index": i, "delta": opening,
                                    "logprobs": None, "finish_reason": None}])
        parsers = [ToolCallParser(reply.tools) if reply.tools else None for _ in streams]
        while open_streams:
            i, out = await merged.get()
            if isinstance(out, Exception):   # one error event and no [DONE]: the stream failed
                yield {"data": json.dumps({"error": stream_error(out)}, ensure_ascii=False)}
                return
            parser = parsers[i]
            if parser is None:
                if out.delta_text:
                    yield reply.chunk([_delta(i, out.delta_text, None, reply.chat)])
            else:
                for delta in _tool_deltas(parser.feed(out.delta_text) + (parser.finish() if out.finished else [])):
                    yield reply.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            if out.finished:
                finals[i] = out
                open_streams -= 1
                finish = _finish_reason(out.finish_reason, parser is not None and parser.calls > 0)
                yield reply.chunk([_delta(i, "", finish, reply.chat)])
        if reply.include_usage:
            outs = list(finals.values())
            yield reply.chunk([], usage=reply.token_usage(streams, outs), tercel=tercel_stats(outs))
        yield {"data": "[DONE]"}
    finally:   # normal end, client disconnect (CancelledError) or error: free the engine's blocks
        for s in streams:
            s.cancel()
        for t in tasks:
            t.cancel()


async def _last(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out


async def _pump(i: int, stream: RequestStream, merged: asyncio.Queue) -> None:
    try:
        async for out in stream:
            await merged.put((i, out))
    except Exception as e:   # noqa: BLE001 - forwarded to the client as an error event
        await merged.put((i, e))


def _choice(i: int, out: RequestOutput, reply: Reply) -> dict:
    if not reply.chat:
        return {"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
    message = {"role": "assistant", "content": out.text}
    finish = out.finish_reason
    if reply.tools is not None:
        parsed = parse_reply(reply.tools, out.text)
        message["content"] = parsed.content
        if parsed.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        finish = _finish_reason(finish, bool(parsed.calls))
    return {"index": i, "message": message, "logprobs": None, "finish_reason": finish}


def _finish_reason(engine_reason: str, called: bool) -> str:
    """OpenAI's "tool_calls" for a reply that called tools and ended by itself."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def _tool_deltas(events: list) -> list[dict]:
    """Parser events as OpenAI's chat deltas: content, a call's index, id and name, then its arguments."""
    deltas = []
    for e in events:
        if isinstance(e, Content):
            deltas.append({"content": e.text})
        elif isinstance(e, CallStart):
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, Arguments):
            deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas


def _delta(i: int, text: str, finish: str | None, chat: bool) -> dict:
    if chat:
        return {"index": i, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
