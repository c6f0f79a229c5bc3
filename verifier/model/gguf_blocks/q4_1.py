"""GGUF Q4_1: d fp16, m fp16, 16 bytes of nibbles; w = d * q + m, 32 weights per block.
Tercel's int4 form exactly (`int4_from_affine`)."""
import numpy as np

from verifier.model.gguf_blocks.base import BlockFormat, f16, nibbles
from verifier.model.quant import Int4Weight, int4_from_affine


def read(blocks: np.ndarray) -> Int4Weight:
    return int4_from_affine(nibbles(blocks, 4), f16(blocks, 0), f16(blocks, 2))


FORMAT = BlockFormat("Q4_1", 32, 20, Int4Weight, read)
