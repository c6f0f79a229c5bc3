"""Occurrences of a context's suffixes in token sequences, and the draft trees they predict.

The suffix tree of SuffixDecoding (Oliaro et al., 2024; Arctic Inference) holds, for every
suffix of every indexed sequence up to a depth, how many times each continuation followed
it. Here the same counts are read from the occurrences themselves: the sequences are kept
as token lists, every position is indexed under the two tokens before it, and a lookup
extends each occurrence of the context's last two tokens backwards to its full match
length. The occurrences matching at least m tokens are the suffix tree's node for the
context's last m tokens; grouping them by the tokens that follow gives that node's subtree
with its counts, expanded only as far as the draft needs. Memory stays one index entry per
token; sequences can grow (a request's output) and be dropped (an evicted cached reply).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from tree.builders import best_first_scored
from tree.token_tree import TokenTree

Occurrence = tuple[list[int], int]      # (a sequence's tokens, the position after the match)


@dataclass(frozen=True)
class DraftLimits:
    """What a draft from one match may hold (SuffixDecoding's rules, plus the request's caps)."""
    max_nodes: int            # the request's draft nodes
    max_depth: int            # the request's deepest node
    topk: int                 # children per node
    spec_factor: float        # at most spec_factor * match length + spec_offset nodes
    spec_offset: float
    min_prob: float           # nodes whose path probability falls below are not drafted

    def nodes_for(self, match_len: int) -> int:
        return max(0, min(self.max_nodes, int(match_len * self.spec_factor + self.spec_offset + 1e-9)))


@dataclass(frozen=True)
class SuffixDraft:
    tree: TokenTree
    probs: tuple[float, ...]   # each draft node's path probability, in node order
    match_len: int

    @property
    def score(self) -> float:
        """Expected accepted tokens if the probabilities hold (SuffixDecoding's score)."""
        return sum(self.probs)


class SuffixIndex:
    """Token sequences by id, each position indexed under the bigram before it."""

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}
        self._follow: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        self._tokens = 0          # tokens of the sequences held
        self._dead = 0            # index entries of dropped sequences, skipped until a rebuild

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (created if new)."""
        seq = self.seqs.setdefault(seq_id, [])
        start = len(seq)
        seq.extend(tokens)
        for i in range(max(start, 2), len(seq)):
            self._follow[(seq[i - 2], seq[i - 1])].append((seq_id, i))
        self._tokens += len(tokens)

    def drop(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        self._tokens -= len(seq)
        self._dead += max(0, len(seq) - 2)
        if self._dead > self._tokens:      # amortised: rebuild once stale entries outnumber the tokens held
            self._rebuild()

    def _rebuild(self) -> None:
        seqs, self.seqs, self._follow = self.seqs, {}, defaultdict(list)
        self._tokens = self._dead = 0
        for seq_id, seq in seqs.items():
            self.extend(seq_id, seq)

    def occurrences(self, context: Sequence[int], max_len: int, limit: int) -> list[tuple[Occurrence, int]]:
        """The `limit` most recent earlier occurrences of the context's last two tokens, each
        with its match length (the context's suffix it repeats, at most max_len tokens)."""
        if len(context) < 2 or max_len < 2:
            return []
        found = []
        for seq_id, pos in reversed(self._follow.get((context[-2], context[-1]), ())):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            m, top = 2, min(max_len, pos, len(context))
            while m < top and seq[pos - m - 1] == context[-m - 1]:
                m += 1
            found.append(((seq, pos), m))
            if len(found) == limit:
                break
        return found


def best_draft(root: int, found: list[tuple[Occurrence, int]], limits: DraftLimits) -> SuffixDraft | None:
    """The best-scoring draft over the match lengths found: for each length m, the tree that
    the occurrences matching at least m tokens predict (best first, by path probability)."""
    best = None
    for m in sorted({m for _, m in found}, reverse=True):
        budget = limits.nodes_for(m)
        if budget < 1 or limits.max_depth < 1:
            continue
        draft = _grow(root, [occ for occ, n in found if n >= m], budget, limits, m)
        if draft.probs and (best is None or draft.score > best.score):
            best = draft
    return best


def _grow(root: int, members: list[Occurrence], budget: int, limits: DraftLimits, match_len: int) -> SuffixDraft:
    """The subtree below one suffix-tree node: a child's share is the fraction of its parent's
    occurrences that continue with its token (occurrences that end count against all)."""
    nodes: dict[tuple[int, ...], tuple[list[Occurrence], float]] = {(): (members, 1.0)}

    def candidates(path: list[int]) -> list[tuple[int, float]]:
        key = tuple(path)
        here, prob = nodes[key]
        groups: dict[int, list[Occurrence]] = defaultdict(list)
        depth = len(path)
        for seq, pos in here:                 # most recent first: ties go to the latest
            if pos + depth < len(seq):
                groups[seq[pos + depth]].append((seq, pos))
        out = []
        for tok, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            share = len(group) / len(here)
            if prob * share < limits.min_prob:
                break
            nodes[(*key, tok)] = (group, prob * share)
            out.append((tok, share))
        return out

    tree, probs = best_first_scored(root, candidates, budget, limits.max_depth, limits.topk)
    return SuffixDraft(tree, tuple(probs), match_len)
