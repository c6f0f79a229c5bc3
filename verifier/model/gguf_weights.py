"""A GGUF's tensors read where they lie in the file (mapped read-only), under HF names: the
loader's view of a GGUF, with no converted copy on disk.

`tensor_index` lists every tensor (its kind, numpy shape and place in the file); it is written
beside the model's config and tokenizer files (`verifier.model.loader`) so that later loads
skip the file's metadata. `GGUFTensors` reads one tensor at a time: dequantized to fp32 for the
dense paths (`quantization="none"`, norms, biases) — in memory, never on disk — or in its own
blocks for the quantized ones (`verifier.model.gguf_quant.read_quantized`).

llama.cpp stores Llama's q/k rows permuted for its interleaved RoPE (undone here, see
`gguf_names`) and Gemma's norm weights with 1 added (subtracted here).
"""
from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np
import torch

from verifier.model.config import GEMMA_TYPES
from verifier.model.gguf_names import by_hf_name, rope_heads, unpermute_rope_rows


def tensor_index(reader) -> list[dict]:
    """Every tensor of the file: name, kind (ggml's type name), shape (numpy order: an expert
    tensor [experts, rows, cols]), offset and bytes in the file."""
    return [{"name": t.name, "kind": t.tensor_type.name, "shape": [int(x) for x in reversed(t.shape)],
             "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]


def dense_tensor(name: str, w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The fp32 values of GGUF tensor `name` as HF holds them (q/k rows back in HF's order,
    Gemma's norms without llama.cpp's added 1)."""
    heads = rope_heads(name, cfg)
    if heads is not None:
        return unpermute_rope_rows(w, heads)
    if cfg["model_type"] in GEMMA_TYPES and name.endswith("norm.weight"):
        return w - 1.0
    return w


def dequantized(data: np.ndarray, kind: str, shape: list[int]) -> torch.Tensor:
    """A tensor's raw bytes -> fp32 [shape], a new array (the mapped bytes are read-only)."""
    from gguf import GGMLQuantizationType, dequantize  # lazy: gguf and its yaml, ~0.09 s on `import spec`
    rows = prod(shape[:-1])
    values = dequantize(np.asarray(data).reshape(rows, -1), GGMLQuantizationType[kind])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


class GGUFTensors:
    """The tensors of one GGUF file by HF name (an expert tensor's slices each by its own)."""

    def __init__(self, path: str | Path, tensors: list[dict], cfg: dict):
        self.path, self.cfg = str(path), cfg
        self._where = by_hf_name(tensors, cfg["model_type"], lambda t: t["shape"][0] if len(t["shape"]) == 3 else 0)

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        """fp32, dequantized in memory (KeyError for a name the file lacks)."""
        t, expert = self._where[name]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t["offset"], shape=(t["nbytes"],))
        shape = t["shape"]
        if expert is not None:
            data, shape = data.reshape(shape[0], -1)[expert], shape[1:]
        return dense_tensor(t["name"], dequantized(data, t["kind"], shape), self.cfg).contiguous()
