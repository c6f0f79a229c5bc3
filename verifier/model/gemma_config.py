"""What Gemma 2 and Gemma 3 (text) add to the Llama shape, read from an HF config.json dict.

Per layer: four RMSNorms computed as x * (1 + w) (input, post_attention, pre_feedforward,
post_feedforward), GeGLU (gelu with the tanh approximation) instead of SwiGLU, a softmax scale of
query_pre_attn_scalar ** -0.5, and either full or sliding-window attention (Gemma 2: layers 0, 2,
4, ... slide; Gemma 3: five of every six, with their own RoPE base). Per model: the embedding
scaled by sqrt(hidden_size), tanh soft-capping of attention scores (Gemma 2) and of the logits
(Gemma 2, optional in Gemma 3), per-head q/k norms (Gemma 3), tied embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verifier.model.rope_config import RopeConfig, rope_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"
# HF's default layer_types: layer i slides unless (i + 1) is a multiple of the pattern
DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# transformers' Gemma2Config / Gemma3TextConfig defaults, for keys a config.json leaves out
_SHARED_DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=4096,
                        query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1)
HF_DEFAULTS = {"gemma2": dict(_SHARED_DEFAULTS, max_position_embeddings=8192, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0),
               "gemma3_text": dict(_SHARED_DEFAULTS, max_position_embeddings=131072)}


@dataclass(frozen=True)
class GemmaConfig:
    query_pre_attn_scalar: float         # the softmax scale is its inverse square root, not head_dim's
    window: int | None                   # a sliding layer's query at position p sees keys at positions > p - window
    sliding: tuple[bool, ...]            # per layer: whether it attends within the window
    local_rope: RopeConfig               # the sliding layers' RoPE (Gemma 3: rope_local_base_freq, unscaled)
    attn_softcap: float | None = None    # scores = cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None   # logits = cap * tanh(logits / cap)

    def __post_init__(self):
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.window}")
        for name, cap in (("attn_logit_softcapping", self.attn_softcap),
                          ("final_logit_softcapping", self.final_softcap)):
            if cap is not None and cap <= 0:
                raise ValueError(f"{name} must be > 0, got {cap}")

    @property
    def scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The window layer `layer` attends within, or None: every earlier key."""
        return self.window if self.sliding[layer] else None


def gemma_from_hf(model_type: str, d: dict[str, Any], num_layers: int) -> tuple[GemmaConfig, RopeConfig]:
    """(the Gemma fields, the full-attention layers' RoPE) of a gemma2 / gemma3_text config
    (`HF_DEFAULTS` already merged in); ValueError naming what Tercel does not serve."""
    activation = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{model_type}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    if d.get("attention_bias"):
        raise ValueError(f"{model_type}: attention_bias (biases on q/k/v/o projections) is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type}: use_bidirectional_attention (an embedding model) is not supported")
    rope, local = _ropes(model_type, d)
    window = d.get("sliding_window")
    cfg = GemmaConfig(
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        window=int(window) if window else None,
        sliding=_sliding_layers(model_type, d, num_layers) if window else (False,) * num_layers,
        local_rope=local,
        attn_softcap=_cap(d.get("attn_logit_softcapping")),
        final_softcap=_cap(d.get("final_logit_softcapping")),
    )
    return cfg, rope


def _cap(value) -> float | None:
    return float(value) if value else None


def _sliding_layers(model_type: str, d: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or DEFAULT_PATTERN[model_type])
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"{model_type}: layer_types must name {num_layers} layers, each {SLIDING!r} or "
                         f"{FULL!r}; got {types}")
    return tuple(t == SLIDING for t in types)


def _ropes(model_type: str, d: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(full-attention layers' RoPE, sliding layers' RoPE). Gemma 2 has one. Gemma 3 reads
    transformers>=5's per-layer-type `rope_parameters` or the older `rope_theta` + `rope_scaling`
    (global layers) and `rope_local_base_freq` (sliding layers, never scaled)."""
    if model_type == "gemma2":
        rope = rope_from_hf(d)
        return rope, rope
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        base = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        full = rope_from_hf({**base, "rope_parameters": params.get(FULL) or {"rope_theta": 1e6}})
        return full, rope_from_hf({**base, "rope_parameters": params.get(SLIDING) or {"rope_theta": 1e4}})
    full = rope_from_hf({**d, "rope_theta": d.get("rope_theta", 1e6)})
    return full, RopeConfig(theta=float(d.get("rope_local_base_freq", 1e4)))


def gguf_fields(arch: str, a, cfg: dict) -> dict[str, Any]:
    """config.json keys of a gemma2 / gemma3 GGUF, as llama.cpp reads its file: `a(key)` reads
    `{arch}.{key}`; `cfg` holds the shapes already read. The file has no query_pre_attn_scalar:
    llama.cpp scales by hidden / heads for the 27B models (46 layers for Gemma 2, 62 for Gemma 3)
    and by the head size otherwise. Gemma 3's sliding layers use a fixed RoPE base of 10,000."""
    big = cfg["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    out = {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
           "hidden_activation": "gelu_pytorch_tanh",
           "final_logit_softcapping": a("final_logit_softcapping"),
           "attn_logit_softcapping": a("attn_logit_softcapping")}
    pattern = a("attention.sliding_window_pattern")
    if isinstance(pattern, list):                     # one flag per layer, where the file has them
        out["layer_types"] = [SLIDING if p else FULL for p in pattern]
    elif pattern:
        out["sliding_window_pattern"] = int(pattern)
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out
