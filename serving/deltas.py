"""One choice of a streamed reply, output by output: the chunks' `choices` entries it makes.

Text deltas (or, for a chat with tools, content and tool-call deltas from the call parser),
the logprobs of the tokens since the last chunk on the first entry of a step (tokens whose
text the detokenizer still holds wait for the next entry), an echoed prompt before the first
completion text, and a last entry with the finish reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.logprobs import TokenPieces, chat_logprobs, completion_logprobs
from serving.reasoning import ReasoningParser, ReasoningSplitter
from serving.tools.formats import ToolFormat
from serving.tools.parser import Arguments, CallStart, Content, ToolCallParser
from spec.request import RequestOutput


@dataclass
class ChoiceDeltas:
    index: int
    chat: bool
    tools: ToolFormat | None = None      # chat with tools: deltas come from the call parser
    pieces: TokenPieces | None = None    # logprobs asked for: how tokens are spelled
    echo: bool = False                   # completions: the prompt first
    reasoning: ReasoningParser | None = None   # chat under --reasoning-parser: reasoning deltas first
    _parser: ToolCallParser | None = field(default=None, init=False)
    _splitter: ReasoningSplitter | None = field(default=None, init=False)
    _sent: int = field(default=0, init=False)      # logprobs entries already sent
    _started: bool = field(default=False, init=False)

    def __post_init__(self):
        if self.tools is not None:
            self._parser = ToolCallParser(self.tools)
        if self.reasoning is not None:
            self._splitter = self.reasoning.splitter()

    @property
    def called(self) -> bool:
        return self._parser is not None and self._parser.calls > 0

    def entries(self, out: RequestOutput) -> list[dict]:
        """The choices entries of one output, the finish entry last when it is the final one."""
        deltas = self._deltas(out)
        if out.finished:
            finish = finish_reason(out.finish_reason, self.called)
            deltas.append(({} if self.chat else {"text": ""}, finish))
        entries = [self._entry(d, finish) for d, finish in deltas]
        if self.pieces is not None and entries and out.logprobs is not None:
            entries[0]["logprobs"] = self._logprobs(out)
        return entries

    def _deltas(self, out: RequestOutput) -> list[tuple[dict, None]]:
        prefix = ""
        if self.echo and not self._started:
            prefix = self.pieces.tokenizer.decode(out.prompt_token_ids) if self.pieces else ""
        self._started = True
        thought, text = self._split(out)
        if self._parser is None:
            text = prefix + text
            return thought + ([({"content": text} if self.chat else {"text": text}, None)] if text else [])
        events = self._parser.feed(text) + (self._parser.finish() if out.finished else [])
        return thought + [(d, None) for d in tool_deltas(events)]

    def _split(self, out: RequestOutput) -> tuple[list[tuple[dict, None]], str]:
        """(the reasoning deltas of this output, the content text after them)."""
        if self._splitter is None:
            return [], out.delta_text
        pieces = self._splitter.feed(out.delta_text) + (self._splitter.finish() if out.finished else [])
        thought = "".join(t for kind, t in pieces if kind == "reasoning")
        return ([({"reasoning_content": thought}, None)] if thought else []), \
            "".join(t for kind, t in pieces if kind == "content")

    def _entry(self, delta: dict, finish: str | None) -> dict:
        if self.chat:
            return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": self.index, **delta, "logprobs": None, "finish_reason": finish}

    def _logprobs(self, out: RequestOutput) -> dict:
        first = self._sent == 0
        new, self._sent = out.logprobs[self._sent:], len(out.logprobs)
        if self.chat:
            return chat_logprobs(new, self.pieces)
        tokens = out.token_ids[len(out.token_ids) - len(new):]
        if first and self.echo:
            return completion_logprobs([*(out.prompt_logprobs or []), *new], self.pieces,
                                       [*out.prompt_token_ids, *tokens])
        return completion_logprobs(new, self.pieces, tokens)


def finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that called tools and ended by itself."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason


def tool_deltas(events: list) -> list[dict]:
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
