"""Quantized weights as plain tensors: the forms Tercel serves, and conversions.

    Int4Weight:  w[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g],  q in 0..15
    Int8Weight:  w[n, k] = q[n, k] * scale[n, k // g],                          q in -127..127
    Int4KWeight: w[n, k] = (d[n, k // 256] * sc[n, k // 32]) * q[n, k]
                           - dmin[n, k // 256] * mn[n, k // 32],                q in 0..15 (GGUF's Q4_K)
    Int8KWeight: w[n, k] = (d[n, k // 256] * sc[n, k // 16]) * q[n, k],        q in -32..31 (GGUF's Q6_K)

The int4 form is the one torch's CPU kernel `_weight_int4pack_mm_for_cpu` computes with
(group size g of 32 to 256). GGUF's Q4_1 blocks (w = d * q + m, 32 weights per block) map
onto it exactly: scale d and zero m + 8d; Q4_0 (w = d * (q - 8)) is zero 0. Int8 with
g = K is torch's per-channel `_weight_int8pack_mm`; GGUF's Q8_0 is g = 32, which that
kernel cannot take, so a Q8_0 matmul weight is requantized per channel (`per_channel`).

Everything here is CPU tensor maths at load time, with no kernel layout: `verifier.quantized.qlinear`
packs these for the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

INT4_GROUPS = (32, 64, 128, 256)    # group sizes the int4 kernel takes


class _Grouped:
    """q [N, K] with one scale per `group` columns of a row (`SCALES` names that scale)."""
    q: torch.Tensor
    SCALES = "scale"

    @property
    def group(self) -> int:
        return self.q.shape[1] // getattr(self, self.SCALES).shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


@dataclass(frozen=True)
class Int4Weight(_Grouped):
    q: torch.Tensor        # uint8 [N, K], values 0..15
    scale: torch.Tensor    # fp32 [N, K // group]
    zero: torch.Tensor     # fp32 [N, K // group]

    def dequantize(self) -> torch.Tensor:
        g = self.group
        return ((self.q.float() - 8) * self.scale.repeat_interleave(g, 1)
                + self.zero.repeat_interleave(g, 1))


@dataclass(frozen=True)
class Int8Weight(_Grouped):
    q: torch.Tensor        # int8 [N, K]
    scale: torch.Tensor    # fp32 [N, K // group]; group == K is per channel

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(self.group, 1)


class KQuantWeight(_Grouped):
    """A K-quant as stored: q [N, K] with a small integer scale `sc` per `group` columns under a
    float d per SUPER; `as_grouped()` gives the same weights in the form with one float scale per
    group (Int4Weight or Int8Weight), for the kernels that take only that."""
    SCALES = "sc"
    SUPER = 256            # weights per d


@dataclass(frozen=True)
class Int4KWeight(KQuantWeight):
    """GGUF's Q4_K as the file stores it: per sub-block of 32 weights a 6-bit scale and min,
    per 256 an fp16 d and dmin. Its products d * sc and dmin * mn are exact in fp32, which a
    bf16 scale per 32 (Int4Weight as served) is not."""
    q: torch.Tensor        # uint8 [N, K], values 0..15
    sc: torch.Tensor       # uint8 [N, K // 32], values 0..63
    mn: torch.Tensor       # uint8 [N, K // 32], values 0..63
    d: torch.Tensor        # fp32 [N, K // 256], fp16 values
    dmin: torch.Tensor     # fp32 [N, K // 256], fp16 values

    def sub_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc, dmin * mn), fp32 [N, K // 32], as ggml computes them."""
        per = self.SUPER // self.group
        return (self.d.repeat_interleave(per, 1) * self.sc.float(),
                self.dmin.repeat_interleave(per, 1) * self.mn.float())

    def dequantize(self) -> torch.Tensor:
        scale, mn = (t.repeat_interleave(self.group, 1) for t in self.sub_scales())
        return self.q.float() * scale - mn

    def as_grouped(self) -> Int4Weight:
        """The same weights in the int4 form: a sub-block is a Q4_1 block of scale d * sc and
        min -dmin * mn."""
        scale, mn = self.sub_scales()
        return int4_from_affine(self.q, scale, -mn)


@dataclass(frozen=True)
class Int8KWeight(KQuantWeight):
    """GGUF's Q6_K as the file stores it: per 16 weights an int8 scale, per 256 an fp16 d. Its
    products d * sc are exact in fp32, which a bf16 scale per 16 (Int8Weight as served) is not."""
    q: torch.Tensor        # int8 [N, K]
    sc: torch.Tensor       # int8 [N, K // 16]
    d: torch.Tensor        # fp32 [N, K // 256], fp16 values

    def sub_scales(self) -> torch.Tensor:
        """d * sc, fp32 [N, K // 16], as ggml computes them."""
        return self.d.repeat_interleave(self.SUPER // self.group, 1) * self.sc.float()

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.sub_scales().repeat_interleave(self.group, 1)

    def as_grouped(self) -> Int8Weight:
        """The same weights in the int8 form: a scale d * sc per 16."""
        return Int8Weight(self.q, self.sub_scales())


@dataclass(frozen=True)
class StackedWeight:
    """The row blocks of one fused projection held in different forms or bits, each as the file
    stores it (a Q4_K_M's Q8_0 attn_v below Q5_0 attn_q and attn_k): w = the parts' rows in order."""
    parts: tuple[Int4Weight | Int8Weight | Int4KWeight | Int8KWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


QuantWeight = Int4Weight | Int8Weight | Int4KWeight | Int8KWeight | StackedWeight


def int4_from_affine(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4Weight:
    """Q4_1-style blocks, w = d * q + m (q 0..15; d, m [N, K / group]) -> the kernel's
    (q - 8) * scale + zero form: the same weights, scale d and zero m + 8d."""
    d, m = d.float(), m.float()
    return Int4Weight(q.to(torch.uint8), d, m + 8 * d)


def quantize_int4(w: torch.Tensor, group: int) -> Int4Weight:
    """Asymmetric min/max quantization per group of `group` columns (as GGUF's Q4_1)."""
    n, k = w.shape
    if group not in INT4_GROUPS or k % group:
        raise ValueError(f"int4 group size {group} must be one of {INT4_GROUPS} and divide {k}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).reshape(n, k)
    return int4_from_affine(q, d, lo)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric int8, one scale per `group` columns (None: per channel)."""
    n, k = w.shape
    group = group or k
    if k % group:
        raise ValueError(f"int8 group size {group} must divide {k}")
    g = w.float().reshape(n, k // group, group)
    scale = g.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return Int8Weight(q, scale)


def per_channel(w: Int8Weight) -> Int8Weight:
    """Blockwise int8 (Q8_0) requantized with one scale per output channel."""
    return w if w.group == w.q.shape[1] else quantize_int8(w.dequantize())


def int4_group(in_features: int) -> int:
    """The group size for quantizing a dense weight: 32 (GGUF's block, the most accurate the
    kernel takes), which must divide the input width."""
    if in_features % INT4_GROUPS[0]:
        raise ValueError(f"int4 needs input widths divisible by {INT4_GROUPS[0]}, got {in_features}; "
                         "use quantization 'int8' or 'none' for this model")
    return INT4_GROUPS[0]


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack the output rows of several weights of one kind (q, k, v -> qkv)."""
    first = parts[0]
    if any(type(p) is not type(first) or p.group != first.group for p in parts):
        raise ValueError("fused projections need one quantization kind and group size")
    return type(first)(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(first)))
