"""The modules of a tensor-parallel Llama that talk to the other ranks (torch.distributed's
default group: gloo on CPU, NCCL on CUDA). Which slice each holds: `verifier/model/shard.py`.

Every rank runs the same forward over the same batch, so every collective below is entered
by all ranks in the same order with the same shapes; rank 0 alone needs the logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from verifier.model.linear import Linear
from verifier.model.shard import TensorShard


def all_reduce_ordered(x: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """The sum over ranks of x, the same bits on every rank and whatever the row count.

    With two ranks the all-reduce is one addition per element, a + b == b + a, so it is exact
    in any order. With more, a ring or tree reduction sums an element in an order that
    depends on where the element falls in the tensor, i.e. on the batch's row count: a row's
    logits would depend on what shares its forward, which breaks T=0 identity between
    speculative and plain decoding (docs/design.md, "The exactness contract"). So above two
    ranks the partial sums are gathered and added in rank order."""
    if shard.size == 2:
        dist.all_reduce(x)
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous())
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


class RowParallelLinear(Linear):
    """o_proj and down_proj: this rank's input columns; the partial products are summed over
    ranks. No bias (Llama's o/down have none): it would be added N times."""

    def __init__(self, in_features: int, out_features: int, shard: TensorShard):
        super().__init__(in_features, out_features, bias=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_ordered(super().forward(x), self.shard)       # [T, hidden]


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table (token ids start .. start + rows). Other ids
    look up zeros, and the all-reduce adds the one rank holding each id to zeros: exact."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TensorShard):
        super().__init__(vocab_size // shard.size, hidden_size)
        self.start = shard.vocab_start(vocab_size)
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start                                          # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))                # [T, hidden]
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x)
        return x


class VocabParallelHead(Linear):
    """The LM head's rows for this rank's vocabulary slice: logits [N, V/N] per rank, gathered
    on rank 0 into [N, V] in rank order (a concatenation: no arithmetic, exact). The other
    ranks return their slice, which nothing reads."""

    def __init__(self, hidden_size: int, vocab_size: int, shard: TensorShard):
        super().__init__(hidden_size, vocab_size // shard.size, bias=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()                          # [N, V/N]
        if local.shape[0] == 0:      # a step with no sampled row: every rank knows it, skip the collective
            return local.new_empty(0, local.shape[1] * self.shard.size)
        parts = [torch.empty_like(local) for _ in range(self.shard.size)] if self.shard.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else local  # rank 0: [N, V]
