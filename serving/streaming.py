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
from serving.deltas import ChoiceDeltas, finish_reason
from serving.logprobs import TokenPieces, chat_logprobs, completion_logprobs
from serving.prediction import completion_tokens_details
from serving.protocol import bad, envelope, tercel_stats, usage
from serving.reasoning import ReasoningParser
from serving.tools.formats import ToolFormat
from serving.tools.parser import parse_reply
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
    pieces: TokenPieces | None = None  # logprobs asked for: how tokens are spelled
    echo: bool = False                 # completions: the prompt before the text
    predicted: bool = False            # the request carried a prediction: the usage counts its tokens
    reasoning: ReasoningParser | None = None   # chat under --reasoning-parser: reasoning split from content

    def deltas(self, index: int) -> ChoiceDeltas:
        """Choice `index`'s deltas as this reply writes them (every route renders from these)."""
        return ChoiceDeltas(index, self.chat, self.tools, self.pieces, self.echo, self.reasoning)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"data": json.dumps(envelope(self.chunk_object, self.id, self.model, choices, **extra),
                                   ensure_ascii=False)}

    def token_usage(self, streams: list[RequestStream], outs: list[RequestOutput]) -> dict:
        prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(1, self.n)   # each prompt once
        counts = usage(prompt_tokens, sum(len(o.token_ids) for o in outs))
        details = completion_tokens_details(outs) if self.predicted else {}
        if self.reasoning is not None:
            details["reasoning_tokens"] = sum(self.reasoning.tokens(o.token_ids) for o in outs)
        return {**counts, "completion_tokens_details": details} if details else counts


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
        choices = [reply.deltas(i) for i in range(len(streams))]
        while open_streams:
            i, out = await merged.get()
            if isinstance(out, Exception):   # one error event and no [DONE]: the stream failed
                yield {"data": json.dumps({"error": stream_error(out)}, ensure_ascii=False)}
                return
            for entry in choices[i].entries(out):
                yield reply.chunk([entry])
            if out.finished:
                finals[i] = out
                open_streams -= 1
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
        return {"index": i, "text": _echoed(reply, out) + out.text, "logprobs": _completion_logprobs(reply, out),
                "finish_reason": out.finish_reason}
    message = {"role": "assistant", "content": out.text}
    if reply.reasoning is not None:
        split = reply.reasoning.split(out.text)
        # content null where the reply only reasoned (as vLLM); "" stays "" for a reply without a block
        message.update(reasoning_content=split.reasoning,
                       content=split.content or (None if split.reasoning is not None else ""))
    finish = out.finish_reason
    if reply.tools is not None:
        parsed = parse_reply(reply.tools, message["content"] or "")
        message["content"] = parsed.content
        if parsed.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        finish = finish_reason(finish, bool(parsed.calls))
    logprobs = chat_logprobs(out.logprobs, reply.pieces) if reply.pieces and out.logprobs is not None else None
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _echoed(reply: Reply, out: RequestOutput) -> str:
    return reply.pieces.tokenizer.decode(out.prompt_token_ids) if reply.echo and reply.pieces else ""


def _completion_logprobs(reply: Reply, out: RequestOutput) -> dict | None:
    if reply.pieces is None or out.logprobs is None:
        return None
    if reply.echo:
        return completion_logprobs([*(out.prompt_logprobs or []), *out.logprobs], reply.pieces,
                                   [*out.prompt_token_ids, *out.token_ids])
    return completion_logprobs(out.logprobs, reply.pieces, out.token_ids)
