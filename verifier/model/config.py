"""The target model's architecture, read from an HF `config.json` dictionary.

One frozen dataclass covers the Llama family Tercel serves (Llama, Mistral, Qwen2, Qwen3,
Phi-3): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied
LM head, optional q/k/v bias (Qwen2), per-head RMSNorm of q and k before RoPE (Qwen3); Phi-3
checkpoints store the fused qkv_proj and gate_up_proj this package's modules use. Mixtral and
Qwen3-MoE replace the MLP with top-k routed SwiGLU experts (`MoeConfig`, `verifier/model/moe.py`).
Gemma 2 and Gemma 3 (text) add what `verifier/model/gemma_config.py` reads into `ModelConfig.gemma`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verifier.model.gemma_config import HF_DEFAULTS, GemmaConfig, gemma_from_hf
from verifier.model.rope_config import RopeConfig, rope_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2",
                         "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # Qwen2 has bias on q/k/v projections
    qk_norm: bool = False               # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    sliding_window: int | None = None   # every layer's window; max_position is capped to it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: "MoeConfig | None" = None      # Mixtral, Qwen3-MoE: routed experts in place of the MLP
    gemma: GemmaConfig | None = None    # Gemma 2/3: norms, GeGLU, windows per layer, soft-capping

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; "
                             f"Tercel serves {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from an HF config.json dict; raise ValueError naming a missing key."""
        def need(key):
            if key not in d:
                raise ValueError(f"config.json lacks required key {key!r}")
            return d[key]
        model_type = d.get("model_type", "llama")
        if model_type == "gemma3" and "text_config" in d:
            raise ValueError("gemma3: multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration, a "
                             "text_config beside a vision_config) are not supported; serve a gemma3_text one")
        if model_type in GEMMA_TYPES:          # transformers' Gemma defaults for keys the file leaves out
            d = {**HF_DEFAULTS[model_type], **d}
        if model_type == "qwen2":
            bias = True
        else:
            bias = bool(d.get("attention_bias", False))
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{model_type}: partial rotary embeddings (partial_rotary_factor "
                             f"{d['partial_rotary_factor']}) are not supported")
        window = sliding_window(model_type, d)
        max_position = int(d.get("max_position_embeddings", 4096))
        gemma, rope = None, None
        if model_type in GEMMA_TYPES:
            gemma, rope = gemma_from_hf(model_type, d, int(need("num_hidden_layers")))
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position=min(max_position, window) if window else max_position,
            rope=rope or rope_from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            moe=moe_from_hf(model_type, d),
            gemma=gemma,
        )


def sliding_window(model_type: str, d: dict[str, Any]) -> int | None:
    """The window every layer attends within (Mistral's and Phi-3's `sliding_window`), or None.
    Tercel has no windowed attention, so such a model is served up to that many positions,
    where the window holds every earlier token and equals full attention. Qwen2/3 window the
    layers `use_sliding_window` names: refused. Gemma's windows are per layer (`ModelConfig.gemma`)."""
    if model_type in GEMMA_TYPES:
        return None
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if d.get("use_sliding_window") and "sliding_attention" in (d.get("layer_types") or ["sliding_attention"]):
            raise ValueError(f"{model_type}: sliding-window attention layers are not supported "
                             "(use_sliding_window is true in config.json)")
        return None
    window = d.get("sliding_window")
    return int(window) if window else None


@dataclass(frozen=True)
class MoeConfig:
    """Sparse layers: a router picks `top_k` of `num_experts` SwiGLU experts per token."""
    num_experts: int
    top_k: int
    intermediate_size: int              # each expert's width (Qwen3-MoE's moe_intermediate_size)
    norm_topk_prob: bool = True         # the top-k probabilities rescaled to sum to 1 (Mixtral always)
    # Qwen3-MoE rounds the routing weights to the router logits' dtype before scaling; Mixtral keeps fp32
    weights_in_logits_dtype: bool = False
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP of the model's intermediate_size

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must lie in 1..{self.num_experts} (the experts)")

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def moe_from_hf(model_type: str, d: dict[str, Any]) -> MoeConfig | None:
    """The experts of a Mixtral or Qwen3-MoE config.json (None for the dense families); shared
    experts (Qwen2-MoE, DeepSeek) are refused by name."""
    if d.get("shared_expert_intermediate_size") or d.get("n_shared_experts"):
        raise ValueError(f"{model_type}: shared experts (shared_expert_intermediate_size, n_shared_experts) "
                         "are not supported")
    if model_type not in ("mixtral", "qwen3_moe"):
        return None
    # HF's defaults where a key is missing: Mixtral 8 experts, top-2; Qwen3-MoE 128, top-8
    default = (8, 2) if model_type == "mixtral" else (128, 8)
    experts = int(d.get("num_local_experts", d.get("num_experts", default[0])))
    top_k = int(d.get("num_experts_per_tok", default[1]))
    if model_type == "mixtral":
        return MoeConfig(experts, top_k, int(d["intermediate_size"]))
    if experts == 0:                # every layer dense: a Qwen3
        return None
    step = int(d.get("decoder_sparse_step", 1))    # as HF: layer i is sparse when (i + 1) % step == 0
    only = set(d.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(int(d["num_hidden_layers"])) if i in only or (i + 1) % step)
    return MoeConfig(experts, top_k, int(d.get("moe_intermediate_size", d["intermediate_size"])),
                     bool(d.get("norm_topk_prob", False)), True, dense)
