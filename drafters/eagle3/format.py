"""Read and write EAGLE-3 heads in the public layouts (config.json + safetensors).

Tensor names: EAGLE / SpecForge put the decoder layer under `midlayer.`, speculators
under `layers.0.`; everything else (`fc`, `norm`, `lm_head`, `d2t`, `t2d`, optional
`embed_tokens`) is shared. Loading checks every tensor against the shapes the *target*
implies, so a head trained for another model is refused with the offending tensor named.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.head import Eagle3Head
from verifier.model.config import ModelConfig

LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}


class HeadMismatchError(ValueError):
    """The head does not fit the target (or is malformed); the message names the tensor."""


def detect_style(config: dict) -> str:
    return "speculators" if ("speculators_config" in config or "transformer_layer_config" in config) else "eagle"


def load_head(path: str | Path, target: ModelConfig | None = None,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              aux_layer_convention: str | None = None,
              target_head: Callable[[], torch.Tensor] | None = None) -> Eagle3Head:
    """Load a head directory (or its config.json's folder) in either layout.

    `target_head`: gives the target's output table [vocab, hidden] (dense), read only for a head
    whose config sets `lm_head_from_target` (its LM head is those rows, not stored).

    `aux_layer_convention`: how the config's `eagle_aux_hidden_state_layer_ids` count when
    the config does not say: "vllm" (layer inputs, the default) or "sglang" (layer
    outputs; a head trained for SGLang, e.g. by SpecForge). See drafters/eagle3/config.py."""
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"EAGLE-3 head not found: {cfg_path} does not exist")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise HeadMismatchError(f"malformed {cfg_path}: {e}") from None
    try:
        cfg = Eagle3Config.from_dict(raw, target.num_layers if target else None, aux_layer_convention)
    except ValueError as e:      # a flag the forward does not implement, a missing key, ...
        raise HeadMismatchError(f"{cfg_path}: {e}") from None
    tensors = _read_tensors(root)
    if target is not None:
        _check_config(cfg, target)
    head = Eagle3Head(cfg, with_embedding="embed_tokens.weight" in tensors)
    _fill(head, tensors, root)
    if cfg.lm_head_from_target:
        _borrow_lm_head(head, tensors, root, target_head)
    head.storage_dtype = _storage_dtype(tensors)
    head = head.to(device=device, dtype=dtype)   # buffers d2t/t2d keep their integer/bool types
    head.init_rotary(device, dtype)
    return head.eval()


def save_head(head: Eagle3Head, path: str | Path, style: str = "eagle",
              dtype: torch.dtype | None = None, verifier: str | None = None) -> Path:
    """Write config.json and model.safetensors; `dtype` None keeps the dtype the head was loaded
    from (fp32 for a fresh head), so load -> save is bit-identical."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = dtype or getattr(head, "storage_dtype", torch.float32)
    prefix = LAYER_PREFIX[style]
    out = {}
    for name, t in head.state_dict().items():
        if name == "lm_head.weight" and head.cfg.lm_head_from_target:
            continue                     # the target's rows: taken from the target at load
        key = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
        out[key] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
    (root / "config.json").write_text(json.dumps(head.cfg.to_dict(style, verifier), indent=2) + "\n")
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        bins = sorted(root.glob("pytorch_model*.bin"))
        if not bins:
            raise FileNotFoundError(f"no *.safetensors (or pytorch_model.bin) in EAGLE-3 head {root}")
        out = {}
        for b in bins:
            out.update(torch.load(b, map_location="cpu", weights_only=True))
        return {_canonical(k): v for k, v in out.items()}
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[_canonical(k)] = st.get_tensor(k)
    return out


def _canonical(name: str) -> str:
    """Both layouts (and a stray `model.` prefix) map to this module's names."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def _check_config(cfg: Eagle3Config, target: ModelConfig) -> None:
    if cfg.vocab_size != target.vocab_size:
        raise HeadMismatchError(f"head vocab_size {cfg.vocab_size} != target vocab_size {target.vocab_size} "
                                f"(tensor t2d / embed_tokens.weight)")
    if cfg.target_hidden_size != target.hidden_size:
        raise HeadMismatchError(f"tensor fc.weight expects target hidden size {cfg.target_hidden_size}, "
                                f"the target has {target.hidden_size}")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise HeadMismatchError(f"head taps layers {list(cfg.aux_layer_ids)}; the target has "
                                f"{target.num_layers} layers")


def _fill(head: Eagle3Head, tensors: dict[str, torch.Tensor], root: Path) -> None:
    expected = head.state_dict()
    optional = {"d2t", "t2d"} | ({"lm_head.weight"} if head.cfg.lm_head_from_target else set())
    for name, dst in expected.items():
        if name not in tensors:
            if name in optional:
                continue
            raise HeadMismatchError(f"EAGLE-3 head {root} lacks tensor {name!r}")
        src = tensors[name]
        if tuple(src.shape) != tuple(dst.shape):
            raise HeadMismatchError(f"tensor {name!r} of head {root} has shape {tuple(src.shape)}; "
                                    f"this target needs {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))
    if "d2t" not in tensors:        # full vocabulary: draft id = target id
        head.t2d.fill_(True)
    elif "t2d" not in tensors:
        head.t2d[head.draft_to_target] = True
    unknown = sorted(set(tensors) - set(expected) - {n for n in tensors if "rotary_emb" in n})
    if unknown:
        raise HeadMismatchError(f"EAGLE-3 head {root} has unexpected tensors: {', '.join(unknown[:5])}")


def _borrow_lm_head(head: Eagle3Head, tensors: dict[str, torch.Tensor], root: Path,
                    target_head: Callable[[], torch.Tensor] | None) -> None:
    if "lm_head.weight" in tensors:
        raise HeadMismatchError(f"EAGLE-3 head {root} sets lm_head_from_target and also stores "
                                "lm_head.weight: one or the other")
    if target_head is None:
        raise HeadMismatchError(f"EAGLE-3 head {root} takes its LM head from the target's output rows "
                                "(lm_head_from_target): load it with the target (target_head=...)")
    table = target_head()
    want = (head.cfg.vocab_size, head.cfg.hidden_size)
    if tuple(table.shape) != want:
        raise HeadMismatchError(f"EAGLE-3 head {root} borrows the target's LM head as lm_head.weight: "
                                f"the target's is {tuple(table.shape)}, the head needs {want}")
    with torch.no_grad():
        head.lm_head.weight.copy_(table[head.draft_to_target].to(head.lm_head.weight.dtype))


def _storage_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    return tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.float32
