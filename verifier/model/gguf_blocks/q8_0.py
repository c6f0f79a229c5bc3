"""GGUF Q8_0: d fp16, 32 int8; w = d * q, 32 weights per block. Tercel's int8 form in groups
of 32."""
import numpy as np
import torch

from verifier.model.gguf_blocks.base import BlockFormat, f16
from verifier.model.quant import Int8Weight


def read(blocks: np.ndarray) -> Int8Weight:
    rows = blocks.shape[0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return Int8Weight(torch.from_numpy(q.copy()), f16(blocks, 0))


FORMAT = BlockFormat("Q8_0", 32, 34, Int8Weight, read)
