"""The head's layers as the drafter runs them on the CPU.

A draft level reads every weight of the head once, one to four rows at a time, with the
target's forward between levels evicting them from the caches: drafting is bound by the bytes
it reads. Two forms, chosen by `Eagle3Head.for_drafting`:
- "int8": each weight in int8 groups of 32 (as GGUF's Q8_0) on the engine's own kernel
  (csrc/q8_matmul.c, AVX2 or AVX-512 VNNI), a quarter of fp32's bytes;
- "bf16": bf16 on oneDNN at any row count (`Linear.bf16_any_rows`), where oneDNN multiplies bf16.
Draft numbers need not keep their bits across row counts, or match training's: a proposal is
a point mass that the target verifies, so the head's precision moves acceptance only.
"""
from __future__ import annotations

import torch
from torch import nn

from verifier.cpu import cpu_ops
from verifier.model.linear import Linear, onednn_bf16
from verifier.model.quant import quantize_int8
from verifier.quantized.qlinear import QuantLinear

INT8_GROUP = 32        # weights per scale (Q8_0's block)
DRAFT_FORMS = ("int8", "bf16")


def draft_form(device: torch.device) -> str | None:
    """The form the head drafts in on `device`: int8 where the own kernel is built, else bf16
    where oneDNN multiplies it, else None (the head as loaded)."""
    if device.type != "cpu":
        return None
    if cpu_ops.available() and cpu_ops.q4_isa() > 0:
        return "int8"
    return "bf16" if onednn_bf16() else None


class Int8DraftLinear(nn.Module):
    """Head `Linear`s of one input held as int8 groups of 32 on the `q8x16` kernel, their rows
    stacked into one weight: one call gives each layer's output (a tuple where there are
    several). Rows of any dtype in, the same dtype out (the kernel takes and gives bf16)."""

    def __init__(self, *layers: Linear):
        super().__init__()
        if any(x.bias is not None for x in layers) or len({x.in_features for x in layers}) != 1:
            raise ValueError("stacked draft layers take one input and no bias")
        self.in_features, self.sizes = layers[0].in_features, [x.out_features for x in layers]
        w = torch.cat([x.weight.detach().float() for x in layers])
        self.q = QuantLinear(quantize_int8(w, INT8_GROUP), None, plan=None)
        self.q.use_own("q8x16")
        self.q.drop_other_owns()
        self.q.release_source()

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y = self.q.run_own(x.to(torch.bfloat16).contiguous()).to(x.dtype)
        return y if len(self.sizes) == 1 else y.split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.sizes}, int8 groups of {INT8_GROUP}"


def to_bf16_any_rows(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.bf16_any_rows = True
