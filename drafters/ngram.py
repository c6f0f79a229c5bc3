"""Prompt-lookup (n-gram) drafter: no weights.

For the longest suffix of the request's tokens (max_n down to min_n) that occurred
earlier in its prompt or output, propose what followed it. Several earlier occurrences
with different continuations become branches of one tree (most recent first), merged
as a trie. Proposals are deterministic, so acceptance treats them as point masses.

A weak match (a suffix of at most `weak_n` tokens) proposes a single token, the one that
most often followed it: such matches are common and accept less often, and verifying one
draft token costs no more than a plain decode step (2 tokens through the target cost no
more than 1 on Spec-Bench rag). With min_n = 0 the empty suffix counts too: when nothing
matches, the context's most frequent token is proposed (a unigram guess: some such steps
on rag accepted it when the greedy outputs were replayed offline, and it costs nothing).

Figures and commands: docs/performance.md, "Drafters and tree shapes".
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from drafters.base import DraftRequest, LookupDrafter, Proposal
from drafters.registry import register_drafter
from tree.token_tree import TokenTree


@dataclass(frozen=True)
class NgramConfig:
    # Chosen on Spec-Bench summarization and rag (greedy outputs replayed against the
    # measured verify-time curve, then confirmed with bench.speculative): 0-5 with weak_n 1
    # drafts on every step; 3-5 without weak matches drafted on only a minority of them
    # (figures: docs/performance.md, "Drafters and tree shapes").
    min_n: int = 0           # shortest suffix matched (0: the empty suffix, a unigram guess)
    max_n: int = 5           # longest suffix tried first
    weak_n: int = 1          # matches of at most this many tokens propose their most frequent follower
    max_branches: int = 1    # distinct continuations kept (1 = a chain)

    def __post_init__(self):
        if not 0 <= self.min_n <= self.max_n or self.max_n < 1:
            raise ValueError(f"n-gram sizes need 0 <= min_n <= max_n and max_n >= 1, "
                             f"got {self.min_n}, {self.max_n}")
        if self.weak_n < 0:
            raise ValueError(f"weak_n must be >= 0, got {self.weak_n}")
        if self.max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {self.max_branches}")


class NgramIndex:
    """Positions following every n-gram of one request, extended as tokens arrive."""

    def __init__(self, cfg: NgramConfig):
        self.cfg = cfg
        self.seen = 0                                   # tokens indexed so far
        self.follow: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.unigrams: Counter[int] = Counter()         # followers of the empty suffix

    def update(self, tokens: list[int]) -> None:
        # Index position i (the token after an n-gram) once the n-gram ending at i-1 exists.
        for i in range(max(self.seen, 1), len(tokens)):
            self.unigrams[tokens[i]] += 1
            for n in range(max(self.cfg.min_n, 1), self.cfg.max_n + 1):
                if i - n >= 0:
                    self.follow[tuple(tokens[i - n:i])].append(i)
        self.seen = max(self.seen, len(tokens))

    def longest_match(self, tokens: list[int]) -> tuple[int, list[int]]:
        """The longest suffix (max_n down to min_n, at least 1 token) that occurred earlier:
        its length and the positions that followed it; (0, []) when none did."""
        for n in range(min(self.cfg.max_n, len(tokens) - 1), max(self.cfg.min_n, 1) - 1, -1):
            # Positions < len(tokens) only: the suffix's own occurrence indexes nothing yet.
            starts = [p for p in self.follow.get(tuple(tokens[-n:]), ()) if p < len(tokens)]
            if starts:
                return n, starts
        return 0, []

    def continuations(self, tokens: list[int], depth: int,
                      match: tuple[int, list[int]] | None = None) -> list[list[int]]:
        """Continuations of the longest matching suffix (`match`, if the caller has it): a
        strong match's most recent occurrences first, a weak match's most frequent single
        followers, and with min_n = 0 and no match the context's most frequent tokens."""
        n, starts = match if match is not None else self.longest_match(tokens)
        if n == 0:
            return [[t] for t, _ in self.unigrams.most_common(self.cfg.max_branches)] if self.cfg.min_n == 0 else []
        if n <= self.cfg.weak_n:
            followers = Counter(tokens[p] for p in starts)   # ties: the earliest first
            return [[t] for t, _ in followers.most_common(self.cfg.max_branches)]
        paths, seen_first = [], set()
        for p in reversed(starts):
            cont = tokens[p:p + depth]                       # never empty: p < len(tokens)
            if cont[0] not in seen_first:
                seen_first.add(cont[0])
                paths.append(cont)
            if len(paths) == self.cfg.max_branches:
                break
        return paths


class NgramDrafter(LookupDrafter):
    """The index learns verified tokens only; matches read the forced ones too."""
    name = "ngram"

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.config = config
        self._index: dict[int, NgramIndex] = {}

    def propose_one(self, req: DraftRequest) -> Proposal:
        index = self._index.setdefault(req.seq_id, NgramIndex(self.config))
        index.update(req.verified_ids)
        return self._proposal(index, req).truncated(req.max_nodes)

    def _proposal(self, index: NgramIndex, req: DraftRequest, match: tuple[int, list[int]] | None = None) -> Proposal:
        """The continuations of the context's longest match as a trie (subclasses add other
        sources); `match` is index.longest_match(req.token_ids) if the caller has it. Every
        node scores the match's length over max_n + 1: a longer match is a surer one."""
        match = index.longest_match(req.token_ids) if match is None else match
        paths = index.continuations(req.token_ids, req.max_depth, match)[:req.topk]
        if not paths:
            return Proposal(TokenTree.single(req.token_ids[-1]))
        tree = TokenTree.from_paths(req.token_ids[-1], paths)
        return Proposal(tree, scores=(match[0] / (self.config.max_n + 1),) * (tree.num_nodes - 1), score_kind="match")

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


@register_drafter("ngram")
def _build(arg: str, target, speculation) -> NgramDrafter:
    """"ngram" or "ngram:MIN-MAX" (suffix lengths); branches follow speculation.topk."""
    lo, hi = NgramConfig.min_n, NgramConfig.max_n
    if arg:
        try:
            lo, hi = (int(x) for x in arg.split("-"))
        except ValueError:
            raise ValueError(f"ngram drafter takes 'ngram:MIN-MAX', got 'ngram:{arg}'") from None
    return NgramDrafter(NgramConfig(min_n=lo, max_n=hi, max_branches=speculation.topk))
