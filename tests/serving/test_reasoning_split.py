"""The reasoning parsers' split (serving/reasoning.py): the same reasoning and content whole and
streamed, wherever the text is cut into deltas (a marker cut across them included), for both
formats; the tokens counted as reasoning; and the constraint moved past the block."""
from __future__ import annotations

import itertools

import pytest

from serving.reasoning import (DEEPSEEK_R1, QWEN3, ReasoningSplitter, Split, after_reasoning, reasoning_tokens,
                               split_reasoning)
from verifier.sampling.structured import StructuredOutputs

CASES = {
    # text: (qwen3's split, deepseek_r1's split)
    "<think>\nplan a < b </thi nk></think>\n\nThe answer.": (
        Split("\nplan a < b </thi nk>", "The answer."), Split("\nplan a < b </thi nk>", "The answer.")),
    "The answer, no block.": (Split(None, "The answer, no block."), Split("The answer, no block.", "")),
    "thinking only</think>answer </think> kept": (
        Split(None, "thinking only</think>answer </think> kept"), Split("thinking only", "answer </think> kept")),
    "<think>cut off mid-thought </th": (Split("cut off mid-thought </th", ""), Split("cut off mid-thought </th", "")),
    "<thin": (Split(None, "<thin"), Split("<thin", "")),
    "<think></think>": (Split("", ""), Split("", "")),
    "<think>x</think>   \n ": (Split("x", ""), Split("x", "")),
    "": (Split(None, ""), Split("", "")),
}


def streamed(fmt, deltas: list[str]) -> Split:
    s = ReasoningSplitter(fmt)
    pieces = [p for d in deltas for p in s.feed(d)] + s.finish()
    kinds = [k for k, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), "content came before reasoning"
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    return Split(reasoning if s.reasoned else None, "".join(t for k, t in pieces if k == "content"))


def cuts(text: str, n: int):
    """Every way to cut `text` into n + 1 deltas (empty ones included)."""
    for points in itertools.combinations_with_replacement(range(len(text) + 1), n):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize("fmt", [QWEN3, DEEPSEEK_R1], ids=lambda f: f.name)
def test_the_split_is_the_same_whole_and_at_every_cut(fmt, text):
    want = CASES[text][fmt is DEEPSEEK_R1]
    assert split_reasoning(fmt, text) == want
    assert streamed(fmt, list(text)) == want                   # a delta per character
    for deltas in itertools.chain(cuts(text, 1), cuts(text, 2)):
        assert streamed(fmt, deltas) == want, deltas


def test_a_split_that_did_not_hold_a_cut_marker_back_would_be_caught(monkeypatch):
    """The check above fails a splitter that emits a possible marker's start at once."""
    from serving import reasoning
    monkeypatch.setattr(reasoning, "_partial_marker", lambda text, marker: 0)
    text = "<think>a</think>b"
    assert streamed(QWEN3, ["<think>a</th", "ink>b"]) != split_reasoning(QWEN3, text)


class CharTokens:
    """A tokenizer whose tokens are characters."""
    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("text, fmt, want", [
    ("<think>ab</think>\n\ncd", QWEN3, len("<think>ab</think>")),
    ("cd", QWEN3, 0),
    ("ab</think>cd", DEEPSEEK_R1, len("ab</think>")),
    ("<think>never closed", QWEN3, len("<think>never closed")),
    ("never closed", DEEPSEEK_R1, len("never closed")),
])
def test_reasoning_tokens_are_those_up_to_the_closing_marker(text, fmt, want):
    assert reasoning_tokens(fmt, CharTokens(), [ord(c) for c in text]) == want


@pytest.mark.parametrize("fmt", [QWEN3, DEEPSEEK_R1], ids=lambda f: f.name)
def test_the_constraint_holds_what_follows_the_block(fmt):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = after_reasoning(fmt, StructuredOutputs(json=schema)).structural_tag
    grammar = xgr.Grammar.from_structural_tag(tag)
    opened = "" if fmt is DEEPSEEK_R1 else "<think>"
    for text in (f'{opened}a < b, {{"x"}}</think>\n\n{{"a": 1}}', f'{opened}</think>{{"a": 2}}'):
        assert _is_grammar_accept_string(grammar, text), text
    assert not _is_grammar_accept_string(grammar, f'{opened}free</think>\n\nnot JSON')
    assert not _is_grammar_accept_string(grammar, f'{opened}free, never closed {{"a": 1}}')
    assert _is_grammar_accept_string(grammar, '{"a": 3}') == (fmt is QWEN3)   # qwen3: the block is optional
