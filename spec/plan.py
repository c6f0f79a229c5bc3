"""A step's hand-off type: one scheduled sequence on its way through the engine's phases
(spec/engine.py), each phase filling in the fields it owns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from spec.request import Request
from spec.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from drafters.base import Proposal


@dataclass(eq=False)
class SeqPlan:
    """One scheduled sequence on its way through a step: `_draft` makes one per scheduled
    sequence, in the scheduler's order, which is also the forward's; each later phase fills
    in the fields it owns. A row is one new token of the forward, flattened over the batch."""
    seq: ScheduledSeq                   # schedule: the request, its new tokens and tree slots
    ctx_len: int = field(init=False)    # tokens in the KV cache when scheduled: the first new token's slot
    # A prompt chunk with more of the prompt after it: no logits, nothing sampled or emitted.
    mid_prefill: bool = field(init=False)
    proposal: Proposal | None = None    # draft: its tree (root = last token); None: prefill or plain decode
    # draft: nodes 1..forced of the proposal are the grammar's forced chain (jump-forward), the
    # drafter's tree (`drafted`) below it if the drafter drafts ahead, else nothing
    forced: int = 0
    drafted: Proposal | None = None     # draft: the drafter's own proposal, for its counters
    predicted: tuple[int, ...] = ()     # draft: the prediction's chain proposed below the forced tokens
    forced_accepted: int = 0            # accept: forced chain nodes accepted
    # draft: a constrained request's grammar bitmask per sampled row, int32 [rows, W]; None: no grammar
    masks: torch.Tensor | None = None
    # draft: per sampled row, the one token its mask allows, or -1: the rows with one get no
    # logits (the target picks that token with probability 1 whatever they are); None: no grammar
    sole: list[int] | None = None
    first_row: int = 0                  # verify: its first row; it owns rows first_row .. + num_rows
    # verify: a view of the forward's fp32 logits, a row per `logit_rows` entry: [tree nodes, V]
    # for a tree, [1, V] (the last token) for a plain decode step or a prompt's last chunk,
    # [0, V] mid-prompt; rows whose mask allows one token are left out.
    logits: torch.Tensor | None = None
    accepted: tuple[int, ...] = ()      # accept: a tree's accepted nodes, by depth (node j at slot ctx_len + j)
    # accept: tokens to append: a tree's accepted path + one corrected or bonus token, else one
    # sampled token; none mid-prompt
    tokens: list[int] = field(default_factory=list)
    # accept: per token of `tokens`, its logprob (a request that asks for them), else None
    logprobs: list | None = None
    # any phase: what failed for this request alone; later phases skip it and emit fails it
    fault: Exception | None = None

    def __post_init__(self):
        req = self.seq.request
        self.ctx_len = req.num_computed_tokens
        self.mid_prefill = self.ctx_len + self.seq.num_new_tokens < req.num_tokens

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def logit_rows(self) -> list[int]:
        """The sampled rows (tree nodes; 0: a plain step's token) that get logits."""
        rows = self.proposal.tree.num_nodes if self.proposal is not None else 1
        return [u for u in range(rows) if self.sole is None or self.sole[u] < 0]

    @property
    def is_prompt(self) -> bool:
        """A prompt chunk: no tree, more than one new token."""
        return self.proposal is None and self.seq.num_new_tokens > 1

    @property
    def num_rows(self) -> int:
        """New tokens in the forward: every tree node, else the scheduled tokens."""
        return self.proposal.tree.num_nodes if self.proposal is not None else self.seq.num_new_tokens

    @property
    def kept_rows(self) -> list[int] | range:
        """Rows whose KV the commit kept, at positions ctx_len, ctx_len + 1, ...: a tree's root
        and accepted path (after accept), every row otherwise."""
        if self.proposal is None:
            return range(self.first_row, self.first_row + self.num_rows)
        return [self.first_row] + [self.first_row + j for j in self.accepted]
