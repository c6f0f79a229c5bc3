"""Row-invariant dense ops on CUDA: matmuls and norms run on tiles of a fixed row count.

cuBLAS picks its kernel (tile shape, split-K) by the row count, and torch's reductions pick
their layout by the tensor's shape, so in bf16 a row's result depends on how many rows share
the call: a tree node and the same token decoded alone, or a prompt prefilled in one chunk and
after a prefix-cache hit, part at a near-tie, and T=0 speculation no longer equals plain
decoding (first seen on an H200, docs/performance.md). At one fixed row count a row's result
does not depend on its place in the call or on its neighbours (tests/gpu checks this), so
every call runs on tiles of TILE_ROWS rows, the last padded with zeros: the CPU path's rule for
prompt rows (docs/quantization.md, "Exactness").
"""
from __future__ import annotations

from typing import Callable

import torch

TILE_ROWS = 64      # a batch-1 decode step pads to it; on a GPU a 64-row matmul reads the weight once


def in_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 rows: int = TILE_ROWS) -> torch.Tensor:
    """fn (row-wise, [rows, ...] -> [rows, ...]) over x [M, ...] in tiles of `rows` rows."""
    m = x.shape[0]
    if m == rows or m == 0:
        return fn(x)
    tiles = -(-m // rows)
    padded = x
    if m % rows:
        padded = x.new_zeros((tiles * rows, *x.shape[1:]))
        padded[:m] = x
    if tiles == 1:
        return fn(padded)[:m]
    return torch.cat([fn(padded[i * rows:(i + 1) * rows]) for i in range(tiles)])[:m]
