"""Tool calls read back out of a reply's text, as it streams.

One parser serves both shapes of a reply: a stream feeds it each text delta and forwards the
events; a whole reply feeds it the whole text and collects them (`parse_reply`), so the two
always agree. Text outside calls is content. A call is announced once its name is complete
(its index, id and name, as OpenAI's first tool-call delta), then its arguments follow as
they are written, without the format's closing text. Whitespace just before a call or at the
end of the reply is dropped, so a reply that only calls tools has no content.

Under the tool-call constraint every call is whole; a reply cut short (max_tokens) may end
inside one: a call whose name is incomplete is dropped, one whose arguments are incomplete
keeps what was written.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from serving.tools.formats import ToolFormat

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


@dataclass
class ToolCallParser:
    fmt: ToolFormat
    _text: str = ""
    _pos: int = 0              # what is read of _text
    _state: str = "text"       # "text", "name" (after begin) or "arguments"
    _held: str = ""            # trailing whitespace of content, not yet given out
    _calls: int = 0
    _args_from: int = 0        # where the current call's arguments start
    _args_sent: int = 0        # of them, characters given out

    def feed(self, delta: str) -> list:
        self._text += delta
        events: list = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list:
        """The events left at the end of the reply: content that could have begun a call."""
        if self._state != "text":
            return []
        rest, self._pos = self._text[self._pos:], len(self._text)
        return self._content(rest.rstrip(), [])

    @property
    def calls(self) -> int:
        return self._calls

    def _step(self, events: list) -> bool:
        return {"text": self._in_text, "name": self._in_name, "arguments": self._in_arguments}[self._state](events)

    def _in_text(self, events: list) -> bool:
        begin = self.fmt.begin
        at = self._text.find(begin, self._pos)
        if at >= 0:
            self._content(self._text[self._pos:at], events, call_follows=True)
            self._pos, self._state = at + len(begin), "name"
            return True
        safe = len(self._text) - _partial_suffix(self._text, begin, self._pos)
        self._content(self._text[self._pos:safe], events)
        self._pos = safe
        return False

    def _in_name(self, events: list) -> bool:
        at = self._text.find(self.fmt.between, self._pos)
        if at < 0:
            return False
        events.append(CallStart(self._calls, f"call_{uuid.uuid4().hex[:24]}", self._text[self._pos:at]))
        self._args_from = self._args_sent = at + len(self.fmt.between)
        self._pos, self._state = self._args_from, "arguments"
        return True

    def _in_arguments(self, events: list) -> bool:
        try:
            _, end = _DECODER.raw_decode(self._text, self._args_from)
        except ValueError:          # incomplete: all of it is arguments so far
            end = None
        upto = len(self._text) if end is None else end
        if upto > self._args_sent:
            events.append(Arguments(self._calls, self._text[self._args_sent:upto]))
            self._args_sent = upto
        if end is None:
            return False
        closing = self._text[end:end + len(self.fmt.end)]
        if closing != self.fmt.end:
            if self.fmt.end.startswith(closing):
                return False        # the closing text is still coming
            closing = ""            # not this format's closing (unconstrained text): go on reading
        self._pos, self._state = end + len(closing), "text"
        self._calls += 1
        return True

    def _content(self, text: str, events: list, call_follows: bool = False) -> list:
        text = self._held + text
        kept = text.rstrip()
        self._held = "" if call_follows else text[len(kept):]
        if kept:
            events.append(Content(kept))
        return events


def _partial_suffix(text: str, word: str, start: int) -> int:
    """Length of the longest end of text[start:] that is a proper beginning of `word`."""
    for n in range(min(len(word) - 1, len(text) - start), 0, -1):
        if word.startswith(text[len(text) - n:]):
            return n
    return 0


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def parse_reply(fmt: ToolFormat, text: str) -> ParsedReply:
    parser = ToolCallParser(fmt)
    content, calls = [], []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ParsedCall(event.id, event.name))
        else:
            calls[event.index].arguments += event.text
    return ParsedReply("".join(content) or None, calls)
