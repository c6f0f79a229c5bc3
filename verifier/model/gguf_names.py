"""GGUF tensor names as HF checkpoints spell them, and llama.cpp's RoPE row order undone: what
the dense conversion (`gguf_convert`) and the quantized block reader (`gguf_quant`) share."""
from __future__ import annotations

import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Names a family spells its own way: Phi-3 files store the fused projections (ffn_up holds gate
# and up, gate first, as HF does); Gemma has four norms a layer, its ffn_norm the pre-MLP one.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_FUSED_LAYER_NAMES = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                      "gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS}
# The router and the experts ({} is the expert's index), by the HF checkpoint's own names
_MOE_LAYER_NAMES = {
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
                "ffn_up_exps": "block_sparse_moe.experts.{}.w3", "ffn_down_exps": "block_sparse_moe.experts.{}.w2"},
    "qwen3_moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{}.gate_proj",
                  "ffn_up_exps": "mlp.experts.{}.up_proj", "ffn_down_exps": "mlp.experts.{}.down_proj"},
}
ROPE_PERMUTED = ("llama", "mixtral")      # model types whose q/k rows llama.cpp stores in its RoPE order
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    base, kind = gguf_name.rsplit(".", 1)         # kind: weight | bias
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        names = {**_LAYER_NAMES, **_FUSED_LAYER_NAMES.get(model_type, {}), **_MOE_LAYER_NAMES.get(model_type, {})}
        if part not in names:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{idx}.{names[part]}.{kind}"
    if base not in _TOP_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[base]}.{kind}"


def hf_names(gguf_name: str, model_type: str, experts: int) -> list[str]:
    """The HF name of each slice of a tensor: one per expert for `ffn_*_exps`, else one."""
    name = hf_name(gguf_name, model_type)
    return [name.format(e) for e in range(experts)] if "{}" in name else [name]


def by_hf_name(tensors: list[dict], model_type: str, experts_of) -> dict[str, tuple[dict, int | None]]:
    """HF name -> (the index entry it is read from, its expert's slice or None), for every tensor of
    a file's index (`experts_of(entry)`: its expert count, 0 for a matrix)."""
    out = {}
    for t in tensors:
        experts = experts_of(t)
        for e, name in enumerate(hf_names(t["name"], model_type, experts)):
            out[name] = (t, e if experts else None)
    return out


def rope_heads(gguf_name: str, cfg: dict) -> int | None:
    """The head count in whose RoPE row order llama.cpp stored this tensor's rows (None: HF's order)."""
    if cfg["model_type"] not in ROPE_PERMUTED:
        return None
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return cfg["num_attention_heads"]
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return cfg["num_key_value_heads"]
    return None


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp: w.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2); this is the inverse.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
