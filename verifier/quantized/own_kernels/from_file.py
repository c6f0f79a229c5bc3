"""A GGUF's blocks packed straight into an own kernel's layout, without the served form between.

Reading a tensor into its served form (`verifier.model.gguf_blocks`: q unpacked, a byte a weight)
and packing that (`q4x16.pack_q4`, `q4k.pack_q4k`) passes over the weights several times; most of
a large model's load went there. The same layouts come from the file's bytes in one or two
passes: q4x16's nibble bytes are Q4_0's and Q4_1's own bytes reordered (byte j of a block holds
weights j and j + 16 in both), and q4k's are each Q4_K chunk's bytes paired. `PACKERS` maps
(GGUF kind, kernel) to the function; the bytes are the same as packing the served form
(`tests/test_model_sizes.py`). `raw`: uint8 [rows, row bytes], the rows in the served order.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from verifier.model.gguf_blocks.q4_k import k_scales
from verifier.quantized.own_kernels.base import Q4_TILE, Packed

_BF16 = torch.bfloat16


def _tiles(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [ceil(N / 16), 16, ...], channels past N zero."""
    pad = -a.shape[0] % Q4_TILE
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(-1, Q4_TILE, *a.shape[1:])


def _bf16_bytes(t: np.ndarray) -> np.ndarray:
    """fp32 [..., 16] -> its bf16 bytes [..., 32] (round to nearest even, as torch converts)."""
    return torch.from_numpy(np.ascontiguousarray(t)).to(_BF16).view(torch.uint8).numpy()


def _q4x16(raw: np.ndarray, qs_at: int, affine: bool) -> torch.Tensor:
    """Q4_0 (d; w = d (q - 8)) or Q4_1 (d, m; w = d q + m) blocks -> q4x16's layout: per tile and
    block the nibbles, then 16 bf16 scales d and 16 bf16 zeros (0, or m + 8 d in fp32)."""
    n, row = raw.shape
    size = qs_at + 16
    blocks = _tiles(raw.reshape(n, row // size, size))                       # [T, 16 c, nb, size]
    qs = blocks[..., qs_at:].reshape(*blocks.shape[:3], 4, 4)                # byte 4 g + e
    nibbles = qs.transpose(0, 2, 3, 1, 4).reshape(blocks.shape[0], blocks.shape[2], 256)   # [T, nb, g, c, e]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [T, 16, nb]
    zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d if affine \
        else np.zeros_like(d)
    scales = [_bf16_bytes(t.transpose(0, 2, 1)) for t in (d, zero)]          # [T, nb, 32] each
    return torch.from_numpy(np.concatenate([nibbles, *scales], -1))


def q4_0(raw: np.ndarray, n: int) -> Packed:
    return Packed((_q4x16(raw, 2, False), n), 4)


def q4_1(raw: np.ndarray, n: int) -> Packed:
    return Packed((_q4x16(raw, 4, True), n), 4)


def q4_k(raw: np.ndarray, n: int) -> Packed:
    """Q4_K super-blocks -> q4k's layout (`q4k.pack_q4k`): per tile and super-block the channels'
    d, dmin (fp16), their 8 sub-blocks' sc and mn, then each sub-block's nibbles as q4x16 lays a
    block's out. Chunk j of a super-block holds sub-block 2 j in its bytes' low halves and 2 j + 1
    in their high ones: a q4x16 byte pairs bytes l and 16 + l of one chunk."""
    rows, row = raw.shape
    blocks = _tiles(raw.reshape(rows, row // 144, 144))                      # [T, 16 c, S, 144]
    t, _, s, _ = blocks.shape

    def per_channel(a: np.ndarray) -> np.ndarray:                            # [T, 16, S, m] -> [T, S, m * 16]
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(t, s, -1)
    sc, mn = k_scales(blocks[..., 4:16])                                     # [T, 16, S, 8] each
    head = [np.ascontiguousarray(blocks[..., i:i + 2].transpose(0, 2, 1, 3)).reshape(t, s, 32) for i in (0, 2)]
    chunks = blocks[..., 16:].reshape(t, Q4_TILE, s, 4, 2, 16)               # [.., chunk, half, 16 bytes]
    lo, hi = chunks[..., 0, :], chunks[..., 1, :]
    sub = np.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], axis=4)  # [T, 16 c, S, chunk, low/high, 16]
    nibbles = sub.reshape(t, Q4_TILE, s, 8, 4, 4).transpose(0, 2, 3, 4, 1, 5).reshape(t, s, 8 * 256)
    packed = np.concatenate([*head, per_channel(sc), per_channel(mn), nibbles], -1)
    table = torch.tensor([[rows, 4, 256]], dtype=torch.int64)
    return Packed((torch.from_numpy(packed), table, rows), 4)


PACKERS: dict[tuple[str, str], Callable[[np.ndarray, int], Packed]] = {
    ("Q4_0", "q4x16"): q4_0, ("Q4_1", "q4x16"): q4_1, ("Q4_K", "q4k"): q4_k}
