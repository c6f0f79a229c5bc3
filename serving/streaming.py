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
from serving.protocol import bad, envelope, tercel_stats, usage
from spec.request import RequestOutput


@dataclass(frozen=True)
class Reply:
    """One response under way: what its bodies say besides the outputs."""
    id: str                 # chatcmpl-... or cmpl-...
    model: str              # the model name reported
    chat: bool              # a chat completion (messages, deltas) or a text completion
    n: int                  # choices per prompt (usage counts each prompt once)
    include_usage: bool     # streams only: a last chunk with the usage

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"data": json.dumps(envelope(self.chunk_object, self.id, self.model, choices, **extra),
                                   ensure_ascii=False)}

    def token_usage(self, streams: list[RequestStream], outs: list[RequestOutput]) -> dict:
        prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(1, self.n)   # each prompt once
        return usage(prompt_tokens, sum(len(o.token_ids) for o in outs))


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
    choices = [_choice(i, o, reply.chat) for i, o in enumerate(finals)]
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
                yield reply.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
        while open_streams:
            i, out = await merged.get()
            if isinstance(out, Exception):   # one error event and no [DONE]: the stream failed
                yield {"data": json.dumps({"error": stream_error(out)}, ensure_ascii=False)}
                return
            if out.delta_text:
                yield reply.chunk([_delta(i, out.delta_text, None, reply.chat)])
            if out.finished:
                finals[i] = out
                open_streams -= 1
                yield reply.chunk([_delta(i, "", out.finish_reason, reply.chat)])
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


def _choice(i: int, out: RequestOutput, chat: bool) -> dict:
    if chat:
        return {"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                "finish_reason": out.finish_reason}
    return {"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}


def _delta(i: int, text: str, finish: str | None, chat: bool) -> dict:
    if chat:
        return {"index": i, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
