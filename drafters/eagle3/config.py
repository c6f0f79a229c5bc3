"""EAGLE-3 head configuration: read from and written to both public layouts.

EAGLE / SpecForge style: a flat Llama-style `config.json` (`num_hidden_layers: 1`,
`draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`)
with tensors named `midlayer.*`.
speculators style: `speculators_model_type: "eagle3"`, the layer's Llama config under
`transformer_layer_config`, a `speculators_config` block, tensors named `layers.0.*`.

Tapped layers. Tercel counts `eagle_aux_hidden_state_layer_ids` as vLLM does: id i is the
hidden state *entering* decoder layer i, the same number as HF's `hidden_states[i]` (0 =
embedding output). SGLang reads the same key as the *output* of layer i and taps layer
i + 1 (`set_eagle3_layers_to_capture` adds one). A config (`eagle_config` or top level)
says which it means with `aux_hidden_state_layer_ids_convention`: `"layer_input"` (alias
`"vllm"`, the default, what Tercel writes) or `"layer_output"` (alias `"sglang"`, shifted by
one on load); a head that does not say can be loaded with
`load_head(..., aux_layer_convention="sglang")`. Defaults (no ids in the config) are the
same in both engines: inputs of layers 2, n/2 and n-3. vLLM and SGLang both collect the
taps while walking the layers upwards, so the three states are concatenated in ascending
layer order whatever order the config lists them in; Tercel sorts the ids on load.

Flags. Any key that changes the forward and that this head does not implement (e.g.
`norm_before_fc`, `fc_norm`, `attention_bias`, a second decoder layer) is refused at load,
named, instead of ignored; so is any key in `eagle_config` this module does not know and
any unknown `true` boolean (every behaviour flag the public formats added defaults to
false). Harmless keys (`torch_dtype`, `transformers_version`, rope settings...) pass.

`lm_head_from_target` (Tercel's own, written only when true): the head's LM head is the
target's output rows of the draft vocabulary (EAGLE-1 reused the target's head the same way),
frozen in training and not stored, so the file is about half as large; loading it needs the
target's output table (`load_head(..., target_head=...)`). Other engines expect `lm_head.weight`
in the file and cannot load such a head as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifier.model.config import ModelConfig
from verifier.model.rope_config import RopeConfig, rope_from_hf

STYLES = ("eagle", "speculators")

# How a config counts tapped layers -> what to add to reach Tercel's count (layer inputs).
AUX_CONVENTIONS = {"layer_input": 0, "vllm": 0, "layer_output": 1, "sglang": 1}

# Flags that change the head's forward -> the values it implements. vLLM reads them at the
# top level of either layout (speculators writes them there), ModelOpt exports and vLLM's
# `norm_before_fc` also under `eagle_config`; both places are checked.
HEAD_FLAGS: dict[str, tuple] = {
    "norm_before_residual": (False, True),
    "norm_output": (False, True),               # EAGLE-3.1: norm(h) is fed to the next step
    "lm_head_from_target": (False, True),       # Tercel: lm_head is the target's rows, not stored
    "norm_before_fc": (False,),                 # one RMSNorm over cat(aux) before fc
    "fc_norm": (False,),                        # an RMSNorm per tapped state before fc
    "use_aux_hidden_state": (True,),            # False: no fc, EAGLE-1 style input
    "use_input_layernorm_in_first_layer": (True,),
    "use_last_layernorm": (True,),
    "use_mtp_layernorm": (False,),
    "parallel_draft_step": (1,),                # >1: parallel drafting with a mask_hidden input
    "num_aux_hidden_states": (3,),
    "logit_scale": (1.0,),
}
# The decoder layer's own settings (the flat config itself, or `transformer_layer_config`).
LAYER_FLAGS: dict[str, tuple] = {
    "num_hidden_layers": (1,),
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
}
# Keys `eagle_config` may carry besides HEAD_FLAGS; these do nothing for a one-layer,
# one-step head (ModelOpt writes them).
EAGLE_CONFIG_KEYS = frozenset({"eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids_convention",
                               "next_layer_regular", "parallel_draft_heads_num_layers"})
# Booleans ordinary HF / speculators configs set to true without changing the forward.
INERT_TRUE_KEYS = frozenset({
    "use_cache", "tie_word_embeddings", "return_dict", "use_return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "is_decoder", "do_sample", "early_stopping",
    "output_scores", "return_dict_in_generate", "remove_invalid_values", "tie_encoder_decoder",
    "add_cross_attention", "is_encoder_decoder", "has_no_defaults_at_init",
    "_attn_implementation_autoset", "trust_remote_code",
    "embed_requires_grad", "enable_sp_ulysses",             # speculators training switches
})


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """Low, middle and high taps, as the EAGLE-3 paper and its public heads use them."""
    n = num_target_layers
    # Clamped into the model for toy targets with fewer than six layers, where the clamped
    # low tap can exceed the high one: sorted, the order fc's input is concatenated in.
    return tuple(sorted((min(2, n - 1), n // 2, max(0, n - 3))))


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
    aux_layer_ids: tuple[int, ...]    # decoder layers whose input is tapped (HF hidden_states
                                      # index), ascending: the order fc's input is concatenated in
    max_position: int = 8192
    rope: RopeConfig = field(default_factory=RopeConfig)
    norm_before_residual: bool = False  # speculators option: residual taken after hidden_norm
    norm_output: bool = False           # EAGLE-3.1: the next step gets norm(h) instead of h
    lm_head_from_target: bool = False   # lm_head = the target's output rows of the draft vocabulary,
                                        # frozen in training and taken from the target at load

    def __post_init__(self):
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"an EAGLE-3 head taps 3 target layers, config gives {self.aux_layer_ids}")
        if list(self.aux_layer_ids) != sorted(self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be ascending: vLLM and SGLang "
                             "concatenate the tapped states in layer order")
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
                   aux_layer_ids=tuple(sorted(aux_layer_ids or default_aux_layers(target.num_layers))),
                   max_position=target.max_position, rope=target.rope)

    # ---- reading ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], num_target_layers: int | None = None,
                  aux_convention: str | None = None) -> "Eagle3Config":
        """Either layout; `num_target_layers` fills in default taps when the config has none;
        `aux_convention` says how its ids count when the config does not (module docstring)."""
        if "transformer_layer_config" in d or "speculators_config" in d:
            layer = dict(d.get("transformer_layer_config") or {})
            top = d
        else:
            layer, top = d, d
        flags = _check_supported(top, layer)
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
            aux_layer_ids=_aux_layers(top, num_target_layers, aux_convention),
            max_position=int(layer.get("max_position_embeddings", 8192)),
            rope=rope_from_hf(layer),
            norm_before_residual=bool(flags.get("norm_before_residual", False)),
            norm_output=bool(flags.get("norm_output", False)),
            lm_head_from_target=bool(flags.get("lm_head_from_target", False)),
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
        # Top level in both layouts: where vLLM (and speculators) read them.
        flags = {"norm_before_residual": self.norm_before_residual, "norm_output": self.norm_output}
        if self.lm_head_from_target:     # written only when set: other engines need lm_head stored
            flags["lm_head_from_target"] = True
        if style == "eagle":
            return {**layer, "draft_vocab_size": self.draft_vocab_size,
                    "target_hidden_size": self.target_hidden_size, **flags, "eagle_config": aux}
        layer["architectures"] = ["LlamaForCausalLM"]
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, **flags, **aux,
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


def _check_supported(top: dict, layer: dict) -> dict[str, Any]:
    """Refuse what the forward does not implement, naming the key; -> the HEAD_FLAGS set."""
    nested = dict(top.get("eagle_config") or {})
    unknown = sorted(set(nested) - set(HEAD_FLAGS) - EAGLE_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"EAGLE-3 head config: unknown eagle_config key(s) {', '.join(unknown)}; "
                         "refused rather than ignored")
    flags = {k: v for k in HEAD_FLAGS if (v := _one_value(top, nested, k)) is not None}
    _check_values(flags, HEAD_FLAGS, "")
    _refuse_unknown_true(top, "")
    if layer is top:
        _check_values(layer, LAYER_FLAGS, "")
        return flags
    where = "transformer_layer_config."
    _check_values(layer, LAYER_FLAGS, where)
    # speculators builds the layer class from model_type: "qwen3" adds q/k norms.
    _check_values(layer, {"model_type": ("llama",)}, where)
    _check_values(top, {"speculators_model_type": ("eagle3",)}, "")
    _check_values(top.get("speculators_config") or {}, {"algorithm": ("eagle3",)}, "speculators_config.")
    _refuse_unknown_true(layer, where)
    return flags


def _one_value(top: dict, nested: dict, key: str):
    """The key's value, top level first as vLLM reads it; None when unset. Empty and None
    count as unset (ModelOpt writes `[]` for default taps); two different values are refused."""
    values = [v for v in (top.get(key), nested.get(key)) if v is not None and v != []]
    if len(values) == 2 and values[0] != values[1]:
        raise ValueError(f"EAGLE-3 head config sets {key}={values[0]!r} and eagle_config.{key}="
                         f"{values[1]!r}")
    return values[0] if values else None


def _check_values(d: dict, allowed: dict[str, tuple], prefix: str) -> None:
    for key, ok in allowed.items():
        if key in d and d[key] is not None and d[key] not in ok:
            raise ValueError(f"EAGLE-3 head config sets {prefix}{key}={d[key]!r}; Tercel's head "
                             f"implements only {' / '.join(map(repr, ok))}")


def _refuse_unknown_true(d: dict, prefix: str) -> None:
    known = set(HEAD_FLAGS) | set(LAYER_FLAGS) | INERT_TRUE_KEYS
    bad = sorted(k for k, v in d.items() if v is True and k not in known)
    if bad:
        raise ValueError(f"EAGLE-3 head config sets unknown flag(s) {', '.join(prefix + k for k in bad)} "
                         "to true; refused rather than ignored")


def _aux_layers(top: dict, num_target_layers: int | None, assumed: str | None = None) -> tuple[int, ...]:
    """-> Tercel's ids (layer inputs), ascending. vLLM reads the top level, then eagle_config."""
    nested = top.get("eagle_config") or {}
    ids = _one_value(top, nested, "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ValueError("EAGLE-3 head config names no tapped layers and the target is unknown")
        return default_aux_layers(num_target_layers)
    shift = AUX_CONVENTIONS[_aux_convention(top, nested, assumed)]
    return tuple(sorted(int(i) + shift for i in ids))


def _aux_convention(top: dict, nested: dict, assumed: str | None) -> str:
    stated = _one_value(top, nested, "aux_hidden_state_layer_ids_convention")
    for name in (stated, assumed):
        if name is not None and name not in AUX_CONVENTIONS:
            raise ValueError(f"unknown aux_hidden_state_layer_ids_convention {name!r}; "
                             f"use one of {', '.join(AUX_CONVENTIONS)}")
    if stated and assumed and AUX_CONVENTIONS[stated] != AUX_CONVENTIONS[assumed]:
        raise ValueError(f"the head's config says its layer ids count {stated!r}, "
                         f"the loader was told {assumed!r}")
    return stated or assumed or "layer_input"


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
