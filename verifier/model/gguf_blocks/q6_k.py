"""GGUF Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d fp16; weight
group j of 16: w = (d * sc[j]) * (q - 32), 256 weights per block. Each 128-weight half takes 64
bytes of nibbles (weights l and 64 + l from byte l's halves, 32 + l and 96 + l from byte
32 + l's) and 32 bytes of bit pairs (byte l: weights l, 32 + l, 64 + l, 96 + l from low to
high). Served as stored (`Int8KWeight`: q - 32, the int8 scales and d; the q8x16 kernel takes it
in 6 bits), or as the int8 form in groups of 16 of scale d * sc (`Int8KWeight.as_grouped`)."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16
from verifier.model.quant import Int8KWeight


def read(blocks: np.ndarray) -> Int8KWeight:
    n, nsb = blocks.shape[:2]
    ql = blocks[..., :128].reshape(n, nsb, 2, 64)
    qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32)
    q = np.empty((n, nsb, 2, 4, 32), np.uint8)         # bytes throughout: a wider type moves 2-4x the bytes
    q[..., 0, :], q[..., 1, :] = ql[..., :32] & 15, ql[..., 32:] & 15
    q[..., 2, :], q[..., 3, :] = ql[..., :32] >> 4, ql[..., 32:] >> 4
    q |= ((qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3) << 4
    q -= 32                                             # wraps to the int8 value q - 32
    sc = torch.from_numpy(np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, nsb * 16))
    return Int8KWeight(torch.from_numpy(q.view(np.int8).reshape(n, -1)), sc, f16(blocks, 208))


FORMAT = BlockFormat("Q6_K", 256, 210, Int8KWeight, read)
