"""A GGUF's blocks packed straight into an own kernel's layout, without the served form between.

Reading a tensor into its served form (`verifier.model.gguf_blocks`: q unpacked, a byte a weight)
and packing that (`q4x16.pack_q4`, `q4k.pack_q4k`) passes over the weights several times; most of
a large model's load went there. The same layouts come from the file's bytes in one or two
passes: q4x16's nibble bytes are Q4_0's and Q4_1's own bytes reordered (byte j of a block holds
weights j and j + 16 in both), q4k's are each Q4_K chunk's bytes paired, and q8x16's 6-bit
layout is Q6_K's low nibbles paired the same way with its high bits as planes. `PACKERS` maps
(GGUF kind, kernel) to the function; the bytes are the same as packing the served form
(`tests/test_model_sizes.py`). `raw`: uint8 [rows, row bytes], the rows in the served order.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from verifier.cpu import cpu_ops
from verifier.model.gguf_blocks.q4_k import k_scales
from verifier.quantized.own_kernels import q8x16
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


def _pairs(chunks: np.ndarray, high: bool) -> np.ndarray:
    """q4x16's nibble bytes of 32 weights held in the low (or high) halves of 32 bytes
    [..., 32]: byte 4 g + e pairs weights 4 g + e and 16 + 4 g + e."""
    lo, hi = chunks[..., :16], chunks[..., 16:]
    return (lo >> 4) | (hi & 0xF0) if high else (lo & 15) | (hi << 4)


def q6_k(raw: np.ndarray, n: int) -> Packed | None:
    """Q6_K super-blocks -> q8x16's 6-bit layout (`q8x16.pack_q8` of the served `Int8KWeight`):
    u = q + 32 is a low nibble from ql and two bits from qh. Weight 128 h + 32 j + l of a
    super-block (j < 4) lies in ql[h] byte 32 (j % 2) + l, low half for j < 2, and in bits 2 j,
    2 j + 1 of qh[h] byte l. None where every q fits 5 bits (the kernel then holds 5: not this layout)."""
    rows, row = raw.shape
    blocks = raw.reshape(rows, row // 210, 210)
    s = blocks.shape[1]
    ql = blocks[..., :128].reshape(rows, s, 2, 2, 32)                        # [.., h, j % 2, l]
    qh = blocks[..., 128:192].reshape(rows, s, 2, 1, 32)                     # [.., h, 1, l]
    fields = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3    # [.., h, j, l]
    if np.isin(fields, (1, 2)).all():
        return None
    nibbles = np.stack([_pairs(ql, False), _pairs(ql, True)], axis=3)        # [.., h, j // 2, j % 2, 16]
    nibbles = _tiles(nibbles.reshape(rows, s * 8, 4, 4))                     # [T, 16 c, blocks, g, e]
    t = nibbles.shape[0]
    nibbles = nibbles.transpose(0, 2, 3, 1, 4).reshape(t, s * 8, 256)
    bits = torch.from_numpy(_tiles(fields.reshape(rows, s * 8, 32))).view(t, Q4_TILE, s * 8, 2, 4, 4)
    planes = [(q8x16._masks if cpu_ops.q8_plane_masks() else q8x16._planes)((bits >> p) & 1, t, s * 8)
              for p in (0, 1)]
    weights = torch.cat([torch.from_numpy(nibbles), *planes], -1)
    sc = torch.from_numpy(_tiles(np.ascontiguousarray(blocks[..., 192:208]).reshape(rows, s * 8, 2)))
    sc = sc.permute(0, 2, 3, 1).reshape(t, s * 8, 32)                        # [.., block, half, 16 c]
    per_block = torch.cat([weights, sc], -1).view(t, s, -1)
    d = torch.from_numpy(np.ascontiguousarray(_tiles(blocks[..., 208:210]).transpose(0, 2, 1, 3))).reshape(t, s, 32)
    packed = torch.cat([d, per_block], -1).contiguous()
    return Packed((packed, 6, q8x16.SUPER_GROUP, rows), 6)


PACKERS: dict[tuple[str, str], Callable[[np.ndarray, int], Packed | None]] = {
    ("Q4_0", "q4x16"): q4_0, ("Q4_1", "q4x16"): q4_1, ("Q4_K", "q4k"): q4_k, ("Q6_K", "q8x16"): q6_k}
