"""GGUF Q5_0: d fp16, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * (q - 16), 32 weights
per block. Bit j of the 32-bit field is weight j's fifth bit. Tercel's int8 form in groups of
32, q - 16 (5 bits to the q8x16 kernel)."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16, nibbles
from verifier.model.quant import Int8Weight


def read(blocks: np.ndarray) -> Int8Weight:
    n = blocks.shape[0]
    fifth = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")             # [N, nb, 1]
    high = ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4       # [N, nb, 32]
    q = nibbles(blocks, 6).view(n, -1, 32).to(torch.int16) + torch.from_numpy(high) - 16
    return Int8Weight(q.reshape(n, -1).to(torch.int8), f16(blocks, 0))


FORMAT = BlockFormat("Q5_0", 32, 22, Int8Weight, read)
