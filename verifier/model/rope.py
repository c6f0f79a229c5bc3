"""Rotary position embeddings: inverse frequencies for each scaling form, and the rotation.

Formulas follow the published definitions (and match transformers' rope init
functions, which the tests compare against): `linear` divides positions by a
factor, `llama3` rescales low-frequency bands smoothly, `yarn` blends interpolated and
extrapolated frequencies and scales attention.
"""
from __future__ import annotations

import math

import torch

from verifier.model.rope_config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] fp32, attention scaling applied to cos and sin)."""
    base = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    inv_freq = 1.0 / base
    if rope.rope_type == "default":
        return inv_freq.float(), 1.0
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float(), 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope).float(), 1.0
    return _yarn(base, rope, head_dim)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    # Between the two bands interpolate smoothly between scaled and unscaled.
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1 / (factor * base)) * (1 - extrapolation_weight) + (1 / base) * extrapolation_weight
    return inv_freq.float(), float(scale)


class RotaryEmbedding:
    """Precomputed cos/sin tables; `lookup(positions)` gives the per-token rotation once per forward.

    The sine table has the half-split rotation's sign folded in: its first half is negated,
    so that rotate_half(x) * sin == roll(x, D/2) * sin_signed, with the same bits."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, device, dtype):
        inv_freq, scale = inv_freq_and_scale(rope, head_dim)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)               # [P, D], HF's half-split layout
        sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin_signed = (emb.sin() * scale * sign).to(device=device, dtype=dtype)
        self.max_position = max_position

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin_signed: [T, 1, D] (broadcast over heads)
        return (torch.index_select(self.cos, 0, positions).unsqueeze(1),
                torch.index_select(self.sin_signed, 0, positions).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; rotate the two halves of each head (HF convention, not interleaved):
    # x * cos + cat(-x2, x1) * sin, written as a roll against the signed sine (one op fewer).
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
