"""GGUF Q4_K: d fp16, dmin fp16, 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of
nibbles; sub-block j (32 weights): w = (d * sc[j]) * q - dmin * mn[j], 256 weights per block.
The 32-byte chunk c holds weights 64 c + l (low halves) and 64 c + 32 + l (high). A sub-block
is a Q4_1 block whose d and m are products (d * sc, -dmin * mn): Tercel's int4 form in groups
of 32, served by the same kernels."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16
from verifier.model.quant import Int4Weight, int4_from_affine


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes per block -> its 8 sub-blocks' 6-bit scales and mins ([..., 8] each): bytes
    0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3 (and the top bits of
    mins 4-7), 8-11 the low four bits of scales and mins 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def read(blocks: np.ndarray) -> Int4Weight:
    n, nsb = blocks.shape[:2]
    sc, mn = (torch.from_numpy(x).float() for x in k_scales(blocks[..., 4:16]))
    d = f16(blocks, 0)[..., None] * sc                          # [N, nsb, 8], as ggml computes them
    m = f16(blocks, 2)[..., None] * mn
    qs = blocks[..., 16:].reshape(n, nsb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb * 256)     # chunk c: low, then high halves
    return int4_from_affine(torch.from_numpy(q), d.reshape(n, -1), -m.reshape(n, -1))


FORMAT = BlockFormat("Q4_K", 256, 144, Int4Weight, read)
