"""What a weight's own kernel is to a `QuantLinear` (`OwnKernel`), and the weight as it packs it
(`Packed`).

An own kernel multiplies bf16 activations by a quantized weight in its served form
(`verifier.model.quant`) and gives each row the same bits whether the row is alone or among
others: sampled rows (decode steps, tree nodes) run only on such kernels. The native decode loop
(csrc/decode_loop.cpp) calls the same kernels, so each also names its fields there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from verifier.model.quant import QuantWeight

Q4_TILE, Q4_BLOCK = 16, 32      # Tercel's kernels (csrc/q4_matmul.c, q8_matmul.c): channels per tile, weights per block


@dataclass(frozen=True)
class Packed:
    args: tuple       # the kernel's arguments after the activations, its tensors among them
    bits: int         # bits per weight as the kernel holds them


class LoopFields(NamedTuple):
    """An own kernel's entry in decode_loop.cpp's `LinearSpec` (besides n, the output features)."""
    kind: int                         # which kernel the loop calls
    w: torch.Tensor                   # the packed weight
    s: torch.Tensor | None = None     # its scales, where the kernel takes them apart
    group: int = 0                    # weights per scale, where the kernel needs it
    bits: int = 0                     # bits per weight, where the kernel needs it


@dataclass(frozen=True)
class OwnKernel:
    name: str                                           # the matmul path's name in timings and plans
    form: type | tuple[type, ...]                       # the served forms it multiplies (Int4Weight, Int8Weight, ...)
    offered: Callable[[QuantWeight], bool]              # whether it takes this weight on this machine
    pack: Callable[[QuantWeight], Packed]               # the weight (bf16 scales, as served) -> its layout
    mm: Callable[..., torch.Tensor]                     # (x bf16 [M, K], *args) -> bf16 [M, N or more]
    loop: Callable[[Packed], LoopFields]                # its entry in the native loop
