"""Load HF-named safetensors into the fused modules of `LlamaForCausalLM`."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from verifier.model.llama import LlamaForCausalLM
from verifier.model.moe import param_name, split_experts
from verifier.model.shard import TensorShard

# HF projection name -> (our fused module, shard index within it)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _shard_bounds(model: LlamaForCausalLM, fused: str, shard: int, rows: int) -> tuple[int, int]:
    """`rows`: the fused weight's; gate and up take half each (an expert's width differs from the MLP's)."""
    c = model.cfg
    sizes = [c.q_size, c.kv_size, c.kv_size] if fused == "qkv_proj" else [rows // 2] * 2
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def _target_of(name: str) -> tuple[str, int | None]:
    for hf, (fused, shard) in PACKED.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{fused}."), shard
    return name, None


def load_safetensors(model: LlamaForCausalLM, model_dir: Path, shard: TensorShard | None = None) -> None:
    """Copy every checkpoint tensor into the model; ValueError names a missing or misshapen one.
    With a shard, each tensor is read as this rank's slice only (`TensorShard.slice_of`)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if "rotary_emb" in name or (name == "lm_head.weight" and model.cfg.tie_word_embeddings):
                    continue
                for part, tensor in split_experts(name, _read(st, name, shard)):
                    _copy_one(model, params, param_name(part, model.cfg.model_type), tensor, filled)
    missing = sorted(set(params) - filled - ({"lm_head.weight"} if model.cfg.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def _read(st, name: str, shard: TensorShard | None) -> torch.Tensor:
    part = shard.slice_of(name, tuple(st.get_slice(name).get_shape())) if shard is not None else None
    if part is None:
        return st.get_tensor(name)
    rows = slice(part.start, part.stop)
    return st.get_slice(name)[rows] if part.dim == 0 else st.get_slice(name)[:, rows]


def load_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One whole checkpoint tensor by its HF name (KeyError if no file holds it)."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise KeyError(f"no tensor {name!r} in {model_dir}")


def _copy_one(model, params, name: str, tensor: torch.Tensor, filled: set[str]) -> None:
    target, shard = _target_of(name)
    if target not in params:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    dst = params[target].data
    if shard is not None:
        lo, hi = _shard_bounds(model, target.split(".")[-2], shard, dst.shape[0])
        dst = dst[lo:hi]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the config implies {tuple(dst.shape)}")
    dst.copy_(tensor.to(dst.dtype))
    filled.add(target)
