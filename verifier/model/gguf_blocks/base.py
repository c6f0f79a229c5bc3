"""What a GGUF block format is to Tercel (`BlockFormat`), and the byte fields formats share.

ggml stores a quantized row as blocks of `weights` weights in `nbytes` bytes each, little-endian.
A format's `read` turns a tensor's blocks into one of Tercel's served forms
(`verifier.model.quant`): `Int4Weight` (q 0..15, scale and zero per group), which the int4
kernels take, `Int8Weight` (signed q, a scale per group), which the q8x16 kernel takes in
5, 6 or 8 bits, or `Int4KWeight` (Q4_K's own scales), which the q4k kernel takes. Each holds
the file's weights exactly; no float round trip beyond the scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from verifier.model.quant import QuantWeight

BLOCK = 32      # weights per scale group of the 32-weight formats, and of a K-quant's sub-block


@dataclass(frozen=True)
class BlockFormat:
    name: str                                   # ggml's type name, as GGUFReader reports it
    weights: int                                # weights per block
    nbytes: int                                 # bytes per block
    form: type                                  # Int4Weight, Int8Weight or Int4KWeight: what `read` returns
    read: Callable[[np.ndarray], QuantWeight]   # uint8 [rows, blocks per row, nbytes] -> the form


def f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block: [N, nb] fp32."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def nibbles(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The 32 4-bit values of every block from byte `at` (byte j: weight j in its low half,
    weight j + 16 in its high half): [N, nb * 32] uint8 in weight order."""
    qs = blocks[..., at:at + BLOCK // 2]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return torch.from_numpy(q.reshape(q.shape[0], -1))
