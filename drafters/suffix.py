"""Suffix decoding (SuffixDecoding, Oliaro et al., 2024; Arctic Inference; vLLM's `suffix`
method): drafts from what followed the context's longest repeated suffix, in the request's
own prompt and output and in the replies served recently.

Two indexes (drafters/suffix_index.py), as SuffixDecoding keeps two suffix trees:
- per request, its prompt and output (agent loops, code edits and RAG repeat their input);
- across requests, the outputs of the running requests and of the last
  `max_cached_requests` finished ones (least recently finished dropped first), each after
  its prompt's last two tokens: the same reply openings, tool-call shapes and boilerplate
  come back across sessions.
Each step, per request, every match length found in either index proposes the tree its
occurrences predict: best first by path probability (a child's share is how often its token
followed among its parent's occurrences), nodes below `min_token_prob` left out, at most
`max_spec_factor` x the match length + `max_spec_offset` nodes (a longer match is a surer
one). The draft with the most expected tokens (the sum of its nodes' probabilities) wins.
Proposals are deterministic, so acceptance treats them as point masses and the output is
exactly the target's. Each node carries its path probability as the adaptive controller's
score, which then verifies the part of the tree that pays on this machine.

The cross-request index makes a request's drafts depend on other requests' outputs: that
changes speed only, but like a prefix cache it is shared state; `max_cached_requests=0`
keeps every request to its own tokens.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from drafters.base import DraftRequest, LookupDrafter, Proposal
from drafters.config import SpecConfig
from drafters.registry import register_drafter
from drafters.suffix_index import DraftLimits, SuffixIndex, best_draft
from tree.token_tree import TokenTree


@dataclass(frozen=True)
class SuffixConfig:
    # Defaults as vLLM's suffix method, except the cache (Python lists, not C++ trees).
    max_depth: int = 24               # longest suffix matched (suffix_decoding_max_tree_depth)
    max_spec_factor: float = 1.0      # draft nodes per matched token
    max_spec_offset: float = 0.0      # draft nodes added to every match's allowance
    min_token_prob: float = 0.1       # nodes less likely than this (path probability) are left out
    max_cached_requests: int = 1000   # finished outputs kept for other requests (0: none)
    max_occurrences: int = 64         # most recent occurrences read per lookup (bounds a step's work)

    def __post_init__(self):
        if self.max_depth < 2 or self.max_occurrences < 1 or self.max_cached_requests < 0:
            raise ValueError("SuffixConfig needs max_depth >= 2, max_occurrences >= 1 and max_cached_requests >= 0")
        if self.max_spec_factor < 0 or not 0 <= self.min_token_prob <= 1:
            raise ValueError("SuffixConfig needs max_spec_factor >= 0 and min_token_prob in [0, 1]")

    @classmethod
    def parse(cls, arg: str) -> "SuffixConfig":
        """"key=value,..." over the fields, e.g. "max_depth=32,min_token_prob=0.05"."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for item in filter(None, arg.split(",")):
            key, _, value = item.partition("=")
            if key not in types or not value:
                raise ValueError(f"suffix drafter options are key=value with keys {', '.join(types)}; got {item!r}")
            kw[key] = (float if types[key] == "float" else int)(value)
        return cls(**kw)


PROMPT_TAIL = 2       # prompt tokens kept before each output in the cross-request index


class SuffixDrafter(LookupDrafter):
    """Indexes verified tokens only; matches read the forced ones too."""
    name = "suffix"

    def __init__(self, config: SuffixConfig = SuffixConfig()):
        self.config = config
        self.state: dict[int, SuffixIndex] = {}     # per request: prompt and output
        self.served = SuffixIndex()                # outputs, running and recently finished
        self._finished: OrderedDict[int, None] = OrderedDict()

    def propose_one(self, req: DraftRequest) -> Proposal:
        root = req.token_ids[-1]
        verified = req.verified_ids
        own = self.state.setdefault(req.seq_id, SuffixIndex())
        own.extend(0, verified[len(own.seqs.get(0, ())):])
        self._learn_output(req.seq_id, verified, req.num_prompt)
        cfg = self.config
        limits = DraftLimits(req.max_nodes, req.max_depth, req.topk, cfg.max_spec_factor, cfg.max_spec_offset,
                             cfg.min_token_prob)
        drafts = [best_draft(root, index.occurrences(req.token_ids, cfg.max_depth, cfg.max_occurrences), limits)
                  for index in (own, self.served)]
        drafts = [d for d in drafts if d is not None]
        if not drafts:
            return Proposal(TokenTree.single(root))
        best = max(drafts, key=lambda d: d.score)     # ties: the request's own
        return Proposal(best.tree, scores=best.probs, score_kind="suffix")

    def _learn_output(self, seq_id: int, token_ids: list[int], num_prompt: int) -> None:
        """Index the output not yet seen, after the prompt's last PROMPT_TAIL tokens (so a
        reply's first tokens are drafted from how other replies began: the chat template's
        assistant header is the same for all)."""
        if self.config.max_cached_requests == 0:
            return
        self._finished.pop(seq_id, None)           # running again (back from preemption)
        start = max(0, num_prompt - PROMPT_TAIL)
        known = len(self.served.seqs.get(seq_id, ()))
        if len(token_ids) - start > known:
            self.served.extend(seq_id, token_ids[start + known:])

    def finish(self, seq_id: int, token_ids: list[int], num_prompt: int) -> None:
        """Keep the finished output for other requests; the oldest beyond the cache size go."""
        self._learn_output(seq_id, token_ids, num_prompt)
        if seq_id not in self.served.seqs:
            return
        self._finished[seq_id] = None
        while len(self._finished) > self.config.max_cached_requests:
            old, _ = self._finished.popitem(last=False)
            self.served.drop(old)

    def release(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)

    @property
    def cached_outputs(self) -> int:
        """Finished outputs held for other requests."""
        return len(self._finished)

    def forget_history(self) -> None:
        self.served, self._finished = SuffixIndex(), OrderedDict()


@register_drafter("suffix", default_speculation=SpecConfig(num_speculative_tokens=16, topk=4, budget=16))
def _build(arg: str, target, speculation) -> SuffixDrafter:
    """"suffix" or "suffix:key=value,...": SuffixConfig's fields."""
    return SuffixDrafter(SuffixConfig.parse(arg))
