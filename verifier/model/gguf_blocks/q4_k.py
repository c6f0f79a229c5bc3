"""GGUF Q4_K: d fp16, dmin fp16, 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of
nibbles; sub-block j (32 weights): w = (d * sc[j]) * q - dmin * mn[j], 256 weights per block.
The 32-byte chunk c holds weights 64 c + l (low halves) and 64 c + 32 + l (high). Served as
stored (`Int4KWeight`: csrc/q4k_matmul.c takes it); where that kernel is not built, a sub-block
is a Q4_1 block whose d and m are the products d * sc and -dmin * mn (`Int4KWeight.as_grouped`)."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16
from verifier.model.quant import Int4KWeight


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes per block -> its 8 sub-blocks' 6-bit scales and mins ([..., 8] each): bytes
    0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3 (and the top bits of
    mins 4-7), 8-11 the low four bits of scales and mins 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def read(blocks: np.ndarray) -> Int4KWeight:
    n, nsb = blocks.shape[:2]
    sc, mn = (torch.from_numpy(np.ascontiguousarray(x).reshape(n, nsb * 8)) for x in k_scales(blocks[..., 4:16]))
    qs = blocks[..., 16:].reshape(n, nsb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb * 256)     # chunk c: low, then high halves
    return Int4KWeight(torch.from_numpy(q), sc, mn, f16(blocks, 0), f16(blocks, 2))


FORMAT = BlockFormat("Q4_K", 256, 144, Int4KWeight, read)
