"""Hand-off types between the engine (`spec/`) and the target model.

The engine describes a step in plain ints; the verifier turns them into tensors once
per forward. Prefill chunks, decode steps and token-tree verification are the same
thing here: some new tokens per sequence, written after that sequence's cached
prefix, attending to the whole prefix and to each other under a mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a forward pass."""

    token_ids: list[int]              # new tokens: a prefill chunk, one decode token, or tree nodes
    ctx_len: int                      # tokens already in this sequence's KV cache; all are attended
    block_table: list[int]            # physical KV blocks, covering ctx_len + len(token_ids) slots
    positions: list[int] | None = None  # RoPE positions; None means ctx_len + i (a chain)
    # Which new tokens attend to which: mask[i][j] is True when token i sees new token j.
    # None means causal. Tree verification passes the ancestor mask (self included).
    mask: torch.Tensor | None = None  # bool [q, q]
    logits_indices: list[int] | None = None  # new tokens that need logits; None means the last one
    # The first new token a quantized target runs as a sampled row (on its row-invariant
    # kernels; the tokens before it are prompt rows). None: the first that needs logits. A
    # decode step whose grammar allows one token needs no logits and is still a sampled row:
    # the same token inside a draft chain is one, and its KV must not depend on which it was.
    sampled_from: int | None = None
    # Per row with logits (in sample_indices order): int64 token ids, the only ones whose logits
    # are needed (a grammar mask that allows few; the rest come back -inf), or None for all.
    # A quantized target computes just those, exactly; others compute every logit.
    logits_tokens: tuple | None = None
    adapter: int = 0                  # the LoRA adapter's slot its rows run under (0: the base)

    def __post_init__(self):
        q = len(self.token_ids)
        if q == 0:
            raise ValueError("SeqInput needs at least one new token")
        if self.sampled_from is not None and not 0 <= self.sampled_from <= min(self.sample_indices, default=q - 1):
            raise ValueError(f"sampled_from {self.sampled_from} must lie in 0..{q - 1}, at or before the first "
                             "token with logits")
        if self.logits_tokens is not None and len(self.logits_tokens) != len(self.sample_indices):
            raise ValueError(f"logits_tokens has {len(self.logits_tokens)} entries for "
                             f"{len(self.sample_indices)} rows with logits")
        if self.positions is not None and len(self.positions) != q:
            raise ValueError(f"positions has {len(self.positions)} entries for {q} tokens")
        if self.mask is not None and tuple(self.mask.shape) != (q, q):
            raise ValueError(f"mask shape {tuple(self.mask.shape)} does not match {q} new tokens")

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.ctx_len + len(self.token_ids)

    @property
    def sample_indices(self) -> list[int]:
        return [self.num_new - 1] if self.logits_indices is None else self.logits_indices

    @property
    def first_sampled(self) -> int:
        """The first sampled row (`sampled_from`); num_new where every row is a prompt row."""
        return self.sampled_from if self.sampled_from is not None else min(self.sample_indices, default=self.num_new)


@dataclass(frozen=True)
class ForwardBatch:
    seqs: list[SeqInput]
    capture_layers: tuple[int, ...] = ()  # hidden states entering these decoder layers are returned


@dataclass
class ForwardOutput:
    logits: torch.Tensor                  # [sum of len(sample_indices)] x vocab, fp32, in seq order
    logits_offsets: list[int]             # seq i's rows are logits[offsets[i]:offsets[i+1]]
    # layer index -> [total new tokens, hidden]: the residual stream entering that layer
    # (HF `hidden_states[layer]`, where index 0 is the embedding output).
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def seq_logits(self, i: int) -> torch.Tensor:
        return self.logits[self.logits_offsets[i]:self.logits_offsets[i + 1]]


def flatten(batch: ForwardBatch) -> tuple[list[int], list[int], list[int], list[int]]:
    """(token ids, positions, logits rows, each sequence's first logits row and the end) of the
    batch's new tokens, sequences one after the other."""
    ids, positions, rows, offsets, t = [], [], [], [0], 0
    for s in batch.seqs:
        ids += s.token_ids
        positions += s.positions if s.positions is not None else list(range(s.ctx_len, s.kv_len))
        rows += [t + i for i in s.sample_indices]
        offsets.append(len(rows))
        t += s.num_new
    return ids, positions, rows, offsets
