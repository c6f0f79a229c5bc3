"""GGUF Q4_0: d fp16, 16 bytes of nibbles; w = d * (q - 8), 32 weights per block.
Tercel's int4 form with zero 0."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16, nibbles
from verifier.model.quant import Int4Weight


def read(blocks: np.ndarray) -> Int4Weight:
    d = f16(blocks, 0)
    return Int4Weight(nibbles(blocks, 2), d, torch.zeros_like(d))


FORMAT = BlockFormat("Q4_0", 32, 18, Int4Weight, read)
