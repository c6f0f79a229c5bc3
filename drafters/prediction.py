"""Predicted outputs (OpenAI's `prediction`): the reply a client expects, such as the file it
asked to have edited, drafted as a chain below the request's last token.

Where the output stands in the prediction (`PredictionIndex.locate`):
- while the output has taken every token of the chain proposed last (at first: the prediction's
  start), where that chain left off;
- after a mismatch (an edit), the output's longest suffix (at most `max_n` tokens) that occurs
  in the prediction, at the occurrence nearest at or after the point the output left the
  prediction (else the nearest before it), so the end of an edit picks the prediction up where
  the unchanged text resumes, as the n-gram drafter matches its context (drafters/ngram.py).
The chain is what follows there. It depends on the prediction and the output so far, never on
this step's randomness, so its nodes are point masses: acceptance is exact at any temperature
(spec/rejection.py), and the reply is the same with or without the prediction.

`join_prediction` makes one proposal of the chain and the server drafter's own.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass

from drafters.base import DraftRequest, LookupDrafter, Proposal
from tree.builders import merge_trees
from tree.token_tree import TokenTree


@dataclass(frozen=True)
class PredictionConfig:
    max_n: int = 8      # longest output suffix looked up in the prediction after a mismatch

    def __post_init__(self):
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")


class PredictionIndex:
    """One request's prediction: the positions after each of its n-grams, and where the output
    was last seen in it."""

    def __init__(self, tokens: tuple[int, ...], max_n: int):
        self.tokens, self.max_n = tokens, max_n
        # n-gram -> the positions just after its occurrences, ascending (never the end: nothing follows)
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for end in range(1, len(tokens)):
            for n in range(1, min(max_n, end) + 1):
                self.ends[tokens[end - n:end]].append(end)
        self.anchor = 0                 # how far the output is known to have followed the prediction
        self.start: int | None = 0      # where the last chain began (None: there was none)
        self.seen = 0                   # output tokens when it was proposed

    def locate(self, output: list[int]) -> tuple[int, float] | None:
        """The position the output continues at, and how sure that is (1: it took the last chain
        whole; n / (max_n + 1) after a mismatch, for a suffix of n tokens); None: nowhere."""
        pos, score = self._follow(output), 1.0
        if pos is None:
            pos, n = self._resync(output)
            score = n / (self.max_n + 1)
        self.start, self.seen = pos, len(output)
        return None if pos is None else (pos, score)

    def _follow(self, output: list[int]) -> int | None:
        """Where the last chain ends if the output took it whole since; moves the anchor to where
        the output left it otherwise (a shorter output: forced tokens spelled otherwise)."""
        if self.start is None or len(output) < self.seen:
            return None
        new = output[self.seen:]
        run = _common_prefix(new, self.tokens[self.start:self.start + len(new)])
        if run:
            self.anchor = max(self.anchor, self.start + run)
        return self.start + run if run == len(new) else None

    def _resync(self, output: list[int]) -> tuple[int | None, int]:
        for n in range(min(self.max_n, len(output)), 0, -1):
            ends = self.ends.get(tuple(output[-n:]))
            if ends:
                i = bisect_left(ends, self.anchor)
                return (ends[i] if i < len(ends) else ends[-1]), n
        return None, 0


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PredictionDrafter(LookupDrafter):
    """Drafts each request's own prediction (`DraftRequest.prediction`); nothing without one.
    The engine runs it beside the server's drafter, or alone where the server has none."""
    name = "prediction"

    def __init__(self, config: PredictionConfig = PredictionConfig()):
        self.config = config
        self._index: dict[int, PredictionIndex] = {}

    def propose_one(self, req: DraftRequest) -> Proposal:
        root = req.token_ids[-1]
        if req.prediction is None:
            return Proposal(TokenTree.single(root))
        index = self._index.get(req.seq_id)
        if index is None:
            index = self._index[req.seq_id] = PredictionIndex(req.prediction.token_ids, self.config.max_n)
        found = index.locate(req.token_ids[req.num_prompt:])
        if found is None:
            return Proposal(TokenTree.single(root))
        pos, score = found
        chain = req.prediction.token_ids[pos:pos + min(req.max_depth, req.max_nodes)]
        if not chain:
            return Proposal(TokenTree.single(root))
        return Proposal(TokenTree.chain(root, list(chain)), scores=(score,) * len(chain), score_kind="prediction")

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


def join_prediction(predicted: Proposal, own: Proposal | None, max_nodes: int) -> Proposal:
    """One request's proposal of at most `max_nodes` draft nodes from the prediction's chain
    and the server drafter's proposal (None: it has none)."""
    if own is None or not predicted.num_draft_nodes:
        return (predicted if own is None else own).truncated(max_nodes)
    if own.draft is not None:
        # A sampled tree's nodes must be its drafter's draws from q: the chain replaces it, never joins it.
        return predicted.truncated(max_nodes)
    # Point masses merge into one tree, the chain first (nodes 1..): a cut keeps it before the drafter's nodes.
    return Proposal(merge_trees([predicted.tree, own.tree]).truncated(max_nodes + 1))


