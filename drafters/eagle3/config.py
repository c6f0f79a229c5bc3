"""EAGLE-3 head configuration: read from and written to both public layouts.

EAGLE / SpecForge style: a flat Llama-style `config.json` (`num_hidden_layers: 1`,
`draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`)
with tensors named `midlayer.*`.
speculators style: `speculators_model_type: "eagle3"`, the layer's Llama config under
`transformer_layer_config`, a `speculators_config` block, tensors named `layers.0.*`.

Tapped layers: Tercel writes `eagle_aux_hidden_state_layer_ids` as the indices of the
decoder layers whose *input* is tapped, which is the same number as HF's
`hidden_states[i]` (index 0 = embedding output). Configs that say
`aux_hidden_state_layer_ids_convention: "layer_output"` count the output of layer i
instead and are shifted by one on load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifier.config import ModelConfig, RopeConfig, _rope_from_hf

STYLES = ("eagle", "speculators")


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high taps, as the EAGLE-3 paper and its public heads use them."""
    n = num_target_layers
    # Clamped into the model for toy targets with fewer than six layers.
    return (min(2, n - 1), n // 2, max(0, n - 3))


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int                  # H: the head's width (= the token embedding width)
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int                   # the target's vocabulary
    draft_vocab_size: int             # rows of lm_head; d2t maps them back to target ids
    target_hidden_size: int           # Ht: width of each tapped hidden state
    aux_layer_ids: tuple[int, ...]    # decoder layers whose input is tapped (HF hidden_states index)
    max_position: int = 8192
    rope: RopeConfig = field(default_factory=RopeConfig)
    norm_before_residual: bool = False  # speculators option: residual taken after hidden_norm

    def __post_init__(self):
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"an EAGLE-3 head taps 3 target layers, config gives {self.aux_layer_ids}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in (0, {self.vocab_size}]")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int,
                   aux_layer_ids: tuple[int, ...] | None = None) -> "Eagle3Config":
        """A head shaped like one decoder layer of the target (the published recipe)."""
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                   head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                   vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
                   target_hidden_size=target.hidden_size,
                   aux_layer_ids=tuple(aux_layer_ids or default_aux_layers(target.num_layers)),
                   max_position=target.max_position, rope=target.rope)

    # ---- reading ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], num_target_layers: int | None = None) -> "Eagle3Config":
        """Either layout; `num_target_layers` fills in default taps when the config has none."""
        if "transformer_layer_config" in d or "speculators_config" in d:
            layer = dict(d.get("transformer_layer_config") or {})
            top = d
        else:
            layer, top = d, d
        hidden = int(_need(layer, "hidden_size"))
        heads = int(_need(layer, "num_attention_heads"))
        vocab = int(_need(layer, "vocab_size") if "vocab_size" in layer else _need(top, "vocab_size"))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_need(layer, "intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab,
            draft_vocab_size=int(top.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
            target_hidden_size=int(top.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
            aux_layer_ids=_aux_layers(top, num_target_layers),
            max_position=int(layer.get("max_position_embeddings", 8192)),
            rope=_rope_from_hf(layer),
            norm_before_residual=bool(top.get("norm_before_residual", False)),
        )

    # ---- writing ---------------------------------------------------------------------
    def to_dict(self, style: str = "eagle", verifier: str | None = None) -> dict[str, Any]:
        if style not in STYLES:
            raise ValueError(f"unknown head layout {style!r}; use one of {', '.join(STYLES)}")
        layer = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu", "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position, "tie_word_embeddings": False,
            **_rope_to_hf(self.rope),
        }
        aux = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
               "aux_hidden_state_layer_ids_convention": "layer_input"}
        if style == "eagle":
            return {**layer, "draft_vocab_size": self.draft_vocab_size,
                    "target_hidden_size": self.target_hidden_size, "eagle_config": aux}
        layer["architectures"] = ["LlamaForCausalLM"]
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "norm_before_residual": self.norm_before_residual, **aux,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": 5}],
                                   "verifier": {"name_or_path": verifier,
                                                "architectures": ["LlamaForCausalLM"]}},
        }


def _need(d: dict, key: str):
    if key not in d:
        raise ValueError(f"EAGLE-3 head config lacks required key {key!r}")
    return d[key]


def _aux_layers(top: dict, num_target_layers: int | None) -> tuple[int, ...]:
    nested = top.get("eagle_config") or {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids", top.get("eagle_aux_hidden_state_layer_ids"))
    convention = nested.get("aux_hidden_state_layer_ids_convention",
                            top.get("aux_hidden_state_layer_ids_convention", "layer_input"))
    if ids is None:
        if num_target_layers is None:
            raise ValueError("EAGLE-3 head config names no tapped layers and the target is unknown")
        return default_aux_layers(num_target_layers)
    if convention == "layer_output":
        return tuple(int(i) + 1 for i in ids)
    if convention != "layer_input":
        raise ValueError(f"unknown aux_hidden_state_layer_ids_convention {convention!r}")
    return tuple(int(i) for i in ids)


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": rope.theta}
    if rope.rope_type != "default":
        scaling = {"rope_type": rope.rope_type, "factor": rope.factor,
                   "original_max_position_embeddings": rope.original_max_position}
        if rope.rope_type == "llama3":
            scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
        if rope.rope_type == "yarn":
            scaling.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
            if rope.attention_factor is not None:
                scaling["attention_factor"] = rope.attention_factor
        out["rope_scaling"] = scaling
    return out
