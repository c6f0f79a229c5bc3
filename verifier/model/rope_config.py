"""Rotary position embeddings as an HF config.json states them (the formulas: `verifier/model/rope.py`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"          # default | linear | llama3 | yarn
    factor: float = 1.0
    # llama3 frequency-band scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; "
                             "supported: default, linear, llama3, yarn")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be > 0, got {self.theta}, {self.factor}")



def rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Read both forms: transformers>=5 `rope_parameters` and older `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    attn_factor = merged.get("attention_factor")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings",
                                             d.get("max_position_embeddings", 8192))),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        attention_factor=None if attn_factor is None else float(attn_factor),
    )
