"""Load a checkpoint's HF-named tensors (safetensors files, or a GGUF read in place) into the
fused modules of `LlamaForCausalLM`."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from verifier.model.gguf_quant import INDEX_FILE
from verifier.model.gguf_weights import GGUFTensors
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


class SafetensorsFiles:
    """An HF checkpoint's tensors by name across its *.safetensors files, read one at a time (a
    file is mapped, a tensor copied out when asked for)."""

    def __init__(self, model_dir: Path):
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_dir}")
        self._file: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                self._file.update({name: f for name in st.keys()})

    def names(self) -> list[str]:
        return list(self._file)

    def get(self, name: str, shard: TensorShard | None = None) -> torch.Tensor:
        """The tensor in its stored dtype; with a shard, this rank's slice only."""
        with safe_open(str(self._file[name]), framework="pt") as st:
            part = shard.slice_of(name, tuple(st.get_slice(name).get_shape())) if shard is not None else None
            if part is None:
                return st.get_tensor(name)
            rows = slice(part.start, part.stop)
            return st.get_slice(name)[rows] if part.dim == 0 else st.get_slice(name)[:, rows]


class _ShardedGGUF:
    """A GGUF's tensors with `get` taking a shard (the slice cut from the whole tensor)."""

    def __init__(self, tensors: GGUFTensors):
        self.tensors = tensors
        self.names = tensors.names

    def get(self, name: str, shard: TensorShard | None = None) -> torch.Tensor:
        w = self.tensors.get(name)
        part = shard.slice_of(name, tuple(w.shape)) if shard is not None else None
        if part is None:
            return w
        return w.narrow(part.dim, part.start, part.stop - part.start).contiguous()


Checkpoint = SafetensorsFiles | _ShardedGGUF


def checkpoint(model_dir: Path) -> Checkpoint:
    """The weights of a model directory: its safetensors files, else the GGUF its tensor index
    names (a GGUF prepared by `verifier.model.loader`, read in place)."""
    index = Path(model_dir) / INDEX_FILE
    if not any(Path(model_dir).glob("*.safetensors")) and index.is_file():
        meta = json.loads(index.read_text())
        if "all" in meta:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
            return _ShardedGGUF(GGUFTensors(meta["gguf"], meta["all"], cfg))
    return SafetensorsFiles(model_dir)


def load_checkpoint(model: LlamaForCausalLM, model_dir: Path, shard: TensorShard | None = None,
                    skip: frozenset[str] = frozenset()) -> None:
    """Copy every checkpoint tensor into the model, except those of parameters named in `skip`
    (left unmaterialized: the quantized runner reads their weights itself); ValueError names a
    missing or misshapen one. With a shard, each tensor is read as this rank's slice only
    (`TensorShard.slice_of`)."""
    source = checkpoint(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    for name in source.names():
        if "rotary_emb" in name or (name == "lm_head.weight" and model.cfg.tie_word_embeddings):
            continue
        if _target_of(param_name(name, model.cfg.model_type))[0] in skip:
            continue
        for part, tensor in split_experts(name, source.get(name, shard)):
            _copy_one(model, params, param_name(part, model.cfg.model_type), tensor, filled)
    missing = sorted(set(params) - filled - skip - ({"lm_head.weight"} if model.cfg.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def param_sources(names: list[str], model_type: str) -> dict[str, set[str]]:
    """Each parameter of the fused modules -> the checkpoint tensors (of `names`) that fill it."""
    out: dict[str, set[str]] = {}
    for name in names:
        out.setdefault(_target_of(param_name(name, model_type))[0], set()).add(name)
    return out


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                skip: frozenset[str] = frozenset()) -> None:
    """Allocate the parameters and buffers of a model built on the meta device, floating ones
    in `dtype`, except the parameters named in `skip` (they stay on meta, taking no memory)."""
    for prefix, module in model.named_modules():
        for attrs in (module._parameters, module._buffers):
            for name, t in attrs.items():
                if t is None or not t.is_meta or f"{prefix}.{name}".lstrip(".") in skip:
                    continue
                # torch.empty, not empty_like: a meta tensor's empty_like imports sympy (0.3 s of a load)
                new = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                attrs[name] = torch.nn.Parameter(new, t.requires_grad) if attrs is module._parameters else new


def load_tensor(model_dir: Path, name: str) -> torch.Tensor:
    """One whole checkpoint tensor by its HF name (KeyError if the checkpoint lacks it)."""
    source = checkpoint(model_dir)
    if name not in source.names():
        raise KeyError(f"no tensor {name!r} in {model_dir}")
    return source.get(name)


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
