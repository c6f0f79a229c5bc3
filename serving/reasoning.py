"""Reasoning output (`--reasoning-parser`): a reply's `<think>...</think>` block split out of its
content, as vLLM and SGLang do, whole or delta by delta; its tokens counted for the usage; and a
request's constraint moved past it, so the reasoning stays free and only the answer is held.

    qwen3        the reply may open a block itself (`<think>` first) or answer at once (Qwen3 with
                 `enable_thinking: false`, whose template writes an empty block into the prompt)
    deepseek_r1  the chat template opened the block: the reply starts inside it (a `<think>`
                 the reply repeats at its start is dropped)

The text after `</think>` loses its leading whitespace (the model's "\n\n" before the answer). A
reply that never closes its block is all reasoning. The split is the same however the text is cut
into deltas: a marker cut across tokens is held back until it is whole or cannot be one.
"""
from __future__ import annotations

from dataclasses import dataclass

from serving.tools.constraint import as_format
from verifier.sampling.structured import StructuredOutputs
from verifier.sampling.thinking import ThinkingBudget

START, END = "<think>", "</think>"
# Whitespace the constraint lets come between the block and the answer (the split drops it; ASCII
# only: a small model given `\s` wrote thin spaces there).
GAP = {"type": "regex", "pattern": r"[ \t\r\n]{0,4}"}


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    opened_by_template: bool     # deepseek_r1: the reply starts inside the block


QWEN3 = ReasoningFormat("qwen3", opened_by_template=False)
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", opened_by_template=True)
REASONING_PARSERS = {f.name: f for f in (QWEN3, DEEPSEEK_R1)}


@dataclass(frozen=True)
class Split:
    reasoning: str | None        # None: the reply had no reasoning block
    content: str


class ReasoningSplitter:
    """Deltas in, ("reasoning" | "content", text) pieces out, in order."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.state = "opening"   # opening -> reasoning -> gap -> content; or opening -> content
        self.reasoned = False    # the reply entered a block
        self._pending = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._pending += text
        out: list[tuple[str, str]] = []
        while self._advance(out):
            pass
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What the deltas held back, once the reply has ended."""
        rest, self._pending = self._pending, ""
        if self.state == "opening":
            self._enter("reasoning" if self.fmt.opened_by_template else "content")
        if not rest or self.state == "gap":
            return []
        return [("reasoning" if self.state == "reasoning" else "content", rest)]

    def _advance(self, out: list) -> bool:
        """One move of the state machine; False when it waits for more text."""
        p = self._pending
        if self.state == "opening":
            if p.startswith(START):
                self._pending = p[len(START):]
                self._enter("reasoning")
            elif START.startswith(p):
                return False                 # "", "<", "<thi": the reply may yet open a block
            else:
                self._enter("reasoning" if self.fmt.opened_by_template else "content")
            return True
        if self.state == "reasoning":
            i = p.find(END)
            if i >= 0:
                _emit(out, "reasoning", p[:i])
                self._pending, self.state = p[i + len(END):], "gap"
                return True
            keep = _partial_marker(p, END)
            _emit(out, "reasoning", p[:len(p) - keep])
            self._pending = p[len(p) - keep:]
            return False
        if self.state == "gap":
            rest = p.lstrip()
            self._pending = rest
            if rest:
                self.state = "content"
            return bool(rest)
        _emit(out, "content", p)
        self._pending = ""
        return False

    def _enter(self, state: str) -> None:
        self.state = state
        self.reasoned = self.reasoned or state == "reasoning"


@dataclass(frozen=True)
class ReasoningParser:
    """The server's reasoning format with the tokenizer that counts its tokens: what a reply needs."""
    fmt: ReasoningFormat
    tokenizer: object

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt)

    def split(self, text: str) -> Split:
        return split_reasoning(self.fmt, text)

    def tokens(self, token_ids: list[int]) -> int:
        return reasoning_tokens(self.fmt, self.tokenizer, token_ids)


def split_reasoning(fmt: ReasoningFormat, text: str) -> Split:
    """A whole reply's reasoning and content (the splitter over one delta)."""
    splitter = ReasoningSplitter(fmt)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    return Split(reasoning if splitter.reasoned else None, "".join(t for kind, t in pieces if kind == "content"))


def reasoning_tokens(fmt: ReasoningFormat, tokenizer, token_ids: list[int]) -> int:
    """How many of a reply's tokens are its reasoning, the closing marker's included: the fewest
    whose text has closed the block (a reply that never closes it: all of them; none without one)."""
    def read(n: int) -> ReasoningSplitter:
        s = ReasoningSplitter(fmt)
        s.feed(tokenizer.decode(token_ids[:n]))
        return s

    def closed(n: int) -> bool:
        s = read(n)
        return s.reasoned and s.state in ("gap", "content")
    whole = read(len(token_ids))
    whole.finish()                        # the reply has ended: an opening held back is settled
    if not whole.reasoned:
        return 0
    if whole.state == "reasoning":        # never closed
        return len(token_ids)
    lo, hi = 0, len(token_ids)            # closed(hi) holds, closed(lo) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if closed(mid) else (mid, hi)
    return hi


def thinking_budget(fmt: ReasoningFormat, tokenizer, tokens: int) -> ThinkingBudget:
    """At most `tokens` tokens of the block, then its closing marker forced: the markers as the
    tokenizer writes them alone (the reasoning models' own special tokens)."""
    def ids(marker: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(marker, add_special_tokens=False))
    return ThinkingBudget(tokens, end_ids=ids(END), start_ids=None if fmt.opened_by_template else ids(START))


def after_reasoning(fmt: ReasoningFormat, constraint: StructuredOutputs) -> StructuredOutputs:
    """`constraint` held on what follows the reasoning block: the block's text free (any text
    without the closing marker), its length bounded only by max_tokens."""
    block = {"type": "tag", "begin": "" if fmt.opened_by_template else START, "content": {"type": "any_text"},
             "end": END}
    first = {"type": "sequence", "elements": [block, GAP]}
    if not fmt.opened_by_template:
        first = {"type": "optional", "content": first}
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": {
        "type": "sequence", "elements": [first, as_format(constraint)]}})


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may be cut)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _emit(out: list, kind: str, text: str) -> None:
    if text:
        out.append((kind, text))
