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
from verifier.quantized.modes import Q8_GROUP
from verifier.quantized.qlinear import QuantLinear

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
        self.q = QuantLinear(quantize_int8(w, Q8_GROUP), None, plan=None, own="q8x16")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y = self.q.run_own(x.to(torch.bfloat16).contiguous()).to(x.dtype)
        return y if len(self.sizes) == 1 else y.split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.sizes}, int8 groups of {Q8_GROUP}"

    def packed_q8(self) -> torch.Tensor | None:
        """The weight as csrc/draft_layer.c takes it (8 bits, groups of 32), or None if packed otherwise."""
        f = self.q.loop_fields()
        return f.w if (f.bits, f.group) == (8, Q8_GROUP) else None


class NativeLayer:
    """The head's decoder layer (`Eagle3Head.project`, `attend`, `finish`) in one C call
    (csrc/draft_layer.c) over its `Int8DraftLinear`s: a draft level's few rows spent more in the
    dispatch of some forty torch ops than in their products."""

    def __init__(self, spec: cpu_ops.DraftLayer, keep: tuple[torch.Tensor, ...]):
        self.spec, self._keep = spec, keep          # the tensors the spec points into

    @classmethod
    def of(cls, head) -> "NativeLayer | None":
        """For an `Eagle3Head` in the int8 form in fp32; None where a projection is packed otherwise."""
        layer, c = head.midlayer, head.cfg
        attn, mlp = layer.self_attn, layer.mlp
        packed = [m.packed_q8() for m in (attn.fused, attn.o_proj, mlp.fused, mlp.down_proj)]
        if head.dtype != torch.float32 or any(p is None for p in packed):
            return None
        norms = [n.weight.detach().float().contiguous() for n in
                 (layer.hidden_norm, layer.input_layernorm, layer.post_attention_layernorm, head.norm)]
        tables = (head.rotary.cos.float().contiguous(), head.rotary.sin_signed.float().contiguous())
        ptr = [t.data_ptr() for t in (*norms, *packed, *tables)]
        spec = cpu_ops.DraftLayer(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                                  int(c.norm_before_residual), int(c.norm_output), len(tables[0]), c.rms_norm_eps,
                                  *ptr)
        return cls(spec, (*norms, *packed, *tables))

    def __call__(self, emb: torch.Tensor, hid: torch.Tensor, positions: torch.Tensor, ctx, tmp, ntmp: int,
                 mask: torch.Tensor) -> torch.Tensor:
        (kc, vc, n_ctx), (kt, vt) = ctx, tmp
        return cpu_ops.draft_layer(self.spec, emb.float().contiguous(), hid.float().contiguous(),
                                   positions.contiguous(), kc, vc, n_ctx, kt, vt, ntmp,
                                   mask.to(torch.uint8).contiguous())


def to_bf16_any_rows(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Linear):
            m.bf16_any_rows = True
