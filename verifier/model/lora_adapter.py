"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read and
checked against the base model it is to run on, its products laid out for Tercel's projections.

PEFT names a low-rank pair per HF module (`...layers.3.self_attn.q_proj.lora_A.weight`: A [r, in],
`lora_B.weight`: B [out, r]); the adapted module computes W x + s B A x with s = alpha / r (rsLoRA:
alpha / sqrt(r)). Tercel serves q, k and v as one projection (`qkv_proj`, rows q | k | v) and gate
and up as one (`gate_up_proj`), so an adapter's product on one is a list of segments, one per part
it adapts (its output columns, its A, its B transposed with s folded in). Phi-3 names its fused
modules as Tercel does: one segment over all the columns.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from verifier.model.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# HF module -> (Tercel's projection, which of its parts); a fused HF module is its whole projection.
PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", 0),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None),
         "down_proj": ("down_proj", 0)}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)"}


@dataclass(frozen=True)
class LoraSegment:
    """Output columns [off, off + n) of a projection get (x @ a.T) @ bt: a [r, in], bt [r, n], in the
    dtype the adapter is held in."""
    off: int
    a: torch.Tensor
    bt: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int                                                 # the largest rank of its pairs
    pairs: dict[tuple[int, str], tuple[LoraSegment, ...]]     # (layer, Tercel projection) -> its segments


def part_sizes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], ...]]:
    """Tercel projection -> (out, in) of each of its parts, in its rows' order."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv_proj": ((cfg.q_size, h), (cfg.kv_size, h), (cfg.kv_size, h)), "o_proj": ((h, cfg.q_size),),
            "gate_up_proj": ((i, h), (i, h)), "down_proj": ((h, i),)}


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """The adapter at `path` for a base of config `cfg`, its segments held in `dtype`; ValueError
    naming the file and the field where it is not a LoRA adapter, does not fit the base or
    exceeds `max_rank`."""
    path = Path(path)
    config = _read_config(path)
    check_lora_base(cfg)
    weights = _read_weights(path / WEIGHTS_FILE)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in weights.items():
        layer, module, side = _parse_key(key, path / WEIGHTS_FILE, cfg.num_layers)
        found.setdefault((layer, module), {})[side] = t.float()
    if not found:
        raise ValueError(f"{path / WEIGHTS_FILE} holds no lora_A / lora_B weights")
    alpha, rs = float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora", False))
    scaled = [_segment(k, v, alpha, rs, cfg, max_rank, path / WEIGHTS_FILE) for k, v in found.items()]
    pairs: dict[tuple[int, str], list[LoraSegment]] = {}
    for key, seg in scaled:
        pairs.setdefault(key, []).append(LoraSegment(seg.off, seg.a.to(dtype), seg.bt.to(dtype)))
    return LoraAdapter(name, path, max(seg.a.shape[0] for _, seg in scaled),
                       {k: tuple(sorted(v, key=lambda s: s.off)) for k, v in pairs.items()})


def check_lora_base(cfg: ModelConfig) -> None:
    """ValueError where adapters cannot run on this base (Gemma's layers, experts)."""
    if cfg.model_type not in LLAMA_FAMILY or cfg.moe is not None:
        raise ValueError(f"LoRA adapters run on {', '.join(LLAMA_FAMILY)} models without experts; "
                         f"this base is {cfg.model_type}{' with experts' if cfg.moe else ''}")


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{path} is not a LoRA adapter: no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise ValueError(f"{file}: {field} is set; {what} adapters are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias is {config['bias']!r}; only 'none' is served (no trained biases)")
    if config.get("modules_to_save"):
        raise ValueError(f"{file}: modules_to_save {config['modules_to_save']} replaces whole modules; "
                         "only LoRA pairs are served")
    if config.get("alpha_pattern"):
        raise ValueError(f"{file}: alpha_pattern is not served (one lora_alpha for every module)")
    return config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ValueError(f"{file.parent} is not a LoRA adapter: no {file.name}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a safetensors file: {e}") from e


def _parse_key(key: str, file: Path, num_layers: int) -> tuple[int, str, str]:
    """(layer, HF module, "A" or "B") of a PEFT weight name."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, module, side = int(parts[at + 1]), parts[-3], parts[-2]
    except (ValueError, IndexError):
        raise ValueError(f"{file}: weight {key!r} is not a LoRA pair of a decoder layer") from None
    if side not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise ValueError(f"{file}: weight {key!r} is not a lora_A / lora_B weight")
    if module not in PARTS:
        raise ValueError(f"{file}: weight {key!r} adapts {module!r}; served: {', '.join(PARTS)}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"{file}: weight {key!r} names layer {layer}; the base has {num_layers}")
    return layer, module, side[-1]


def _segment(key: tuple[int, str], sides: dict[str, torch.Tensor], alpha: float, rs: bool, cfg: ModelConfig,
             max_rank: int, file: Path) -> tuple[tuple[int, str], LoraSegment]:
    """((layer, Tercel projection), its segment) of one HF module's pair, checked against the
    module's shape in the base."""
    layer, module = key
    if set(sides) != {"A", "B"}:
        raise ValueError(f"{file}: layer {layer} {module} has lora_{''.join(sides)} without its other half")
    a, b = sides["A"], sides["B"]
    projection, part = PARTS[module]
    sizes = part_sizes(cfg)[projection]
    out, inp = (sum(o for o, _ in sizes), sizes[0][1]) if part is None else sizes[part]
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, r):
        raise ValueError(f"{file}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                         f"do not fit the base's {module} ({out} x {inp}, expected A [r, {inp}], B [{out}, r])")
    if r > max_rank:
        raise ValueError(f"{file}: layer {layer} {module} has rank {r}, above max_lora_rank {max_rank}")
    off = 0 if part is None else sum(o for o, _ in sizes[:part])
    scale = alpha / (math.sqrt(r) if rs else r)
    return (layer, projection), LoraSegment(off, a.contiguous(), (b * scale).t().contiguous())
