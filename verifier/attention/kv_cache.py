"""Per-layer paged KV block pools.

Layout per layer: k, v: [num_blocks, block_size, kv_heads, head_dim]. A token at
logical position p of a sequence lives in block block_table[p // block_size] at
offset p % block_size, i.e. at physical slot block_table[p // bs] * bs + p % bs of the
flattened pool. The Triton kernels use the same layout.
"""
from __future__ import annotations

import math
import mmap

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # each layer's (k, v) views, made once: indexing a tensor costs microseconds, 60 per step
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Move K/V of physical slots src[i] -> dst[i] in every layer (tree commit).
        The sources are gathered before any write, so overlapping moves are safe."""
        if self.k.is_cuda:
            # lazy: triton is Linux-only; importing the kernels fixes TRITON_INTERPRET (the tests set it first)
            from verifier.attention.triton_kernels import commit_kv
            s = torch.tensor(src, device=self.k.device)
            d = torch.tensor(dst, device=self.k.device)
            commit_kv(self.k, self.v, s, d)
            return
        s, d = torch.tensor(src), torch.tensor(dst)
        for pool in (self.k, self.v):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])   # [L, slots, KVH, D]
            flat[:, d] = flat[:, s]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool. On the CPU it lies in an anonymous mapping, whose pages the kernel commits
    only when first written: a pool costs resident memory for the blocks requests have used, not
    for its size (torch.zeros writes every page), and the mapping goes when the last view does."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def slot_of(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Physical slots of logical positions [start, end) of one sequence."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
