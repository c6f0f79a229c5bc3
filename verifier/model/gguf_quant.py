"""Read a GGUF's quantized tensors in the formats Tercel serves as stored
(`verifier.model.gguf_blocks`), without a float round trip: where each tensor's blocks lie in the
file (`block_index`, written beside the converted checkpoint) and the weights under HF names
(`read_quantized`)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from verifier.model.gguf_blocks import FORMATS, read_block_tensor
from verifier.model.gguf_names import by_hf_name, rope_heads, unpermute_rope_rows
from verifier.model.quant import QuantWeight


def _unpermute(w: QuantWeight, heads: int) -> QuantWeight:
    # Undo llama.cpp's RoPE row order (see gguf_names); blocks run along a row, so each
    # field permutes its rows alike.
    fields = {name: unpermute_rope_rows(getattr(w, name), heads).contiguous()
              for name in w.__dataclass_fields__}
    return type(w)(**fields)


INDEX_FILE = "gguf_blocks.json"


def block_index(reader, gguf_path: Path) -> dict:
    """Where each quantized tensor's blocks lie in the GGUF file; written beside the
    converted checkpoint so that later loads map the blocks without parsing the file's
    metadata again (the tokenizer fields alone take GGUFReader seconds; figures:
    docs/performance.md, "Load and import times")."""
    # "experts": the slices of a 3-D ffn_*_exps tensor (0: a matrix)
    tensors = [{"name": t.name, "kind": t.tensor_type.name, "rows": int(t.shape[1]), "cols": int(t.shape[0]),
                "experts": int(t.shape[2]) if len(t.shape) == 3 else 0,
                "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
               for t in reader.tensors if t.tensor_type.name in FORMATS]
    # the decoder's matrices stored otherwise (Q5_K, IQ types, F16, ...): dense here, requantized by a quantized path
    others = sorted({t.tensor_type.name for t in reader.tensors
                     if t.name.startswith("blk.") and len(t.shape) >= 2 and t.tensor_type.name not in FORMATS})
    return {"gguf": str(Path(gguf_path).resolve()), "tensors": tensors, "other_kinds": others}


class FileRows(NamedTuple):
    """One tensor's rows as the file holds them, in the served order."""
    kind: str               # GGUF type name
    cols: int
    address: np.ndarray     # int64 [rows]: each row's first byte
    keep: np.ndarray        # the mapping the addresses point into


def file_rows(kind: str, cols: int, data: np.ndarray, order: np.ndarray | None = None) -> FileRows:
    """`data` [rows, row bytes] (C-contiguous, mapped or not); `order`: the file's row for each served row."""
    rows, row_bytes = data.shape
    index = np.arange(rows, dtype=np.int64) if order is None else np.asarray(order, np.int64)
    return FileRows(kind, cols, data.ctypes.data + row_bytes * index, data)


class QuantizedTensors(Mapping):
    """HF name -> weight for every tensor of the indexed file in a format of `FORMATS`, one per
    expert for an ffn_*_exps tensor (others come dense from the checkpoint), each read from the
    mapped file when asked for: a model's weights are never all unpacked at once."""

    def __init__(self, index: dict, cfg: dict):
        self._path, self._cfg = index["gguf"], cfg
        self._where = by_hf_name(index["tensors"], cfg["model_type"], lambda t: t.get("experts", 0))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:         # without reading the tensor, as Mapping's would
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __getitem__(self, name: str) -> QuantWeight:
        t, data = self._bytes(name)
        w = read_block_tensor(t["kind"], data, t["rows"], t["cols"])
        heads = rope_heads(t["name"], self._cfg)
        return w if heads is None else _unpermute(w, heads)

    def rows(self, name: str, stop: int) -> QuantWeight:
        """The first `stop` rows of a tensor stored in HF's row order (the head, the embedding)."""
        t, data = self._bytes(name)
        if rope_heads(t["name"], self._cfg) is not None:
            raise ValueError(f"{name}: its rows are stored in llama.cpp's RoPE order")
        stop = min(stop, t["rows"])
        return read_block_tensor(t["kind"], np.asarray(data).reshape(t["rows"], -1)[:stop], stop, t["cols"])

    def kind(self, name: str) -> str:
        """The GGUF type name of the tensor `name` is read from."""
        return self._where[name][0]["kind"]

    def file_rows(self, name: str) -> FileRows:
        """The tensor's rows where the file holds them, in the served order (no copy: the rows of
        q and k move back to HF's order by their addresses)."""
        t, data = self._bytes(name)
        heads = rope_heads(t["name"], self._cfg)
        order = None if heads is None else unpermute_rope_rows(torch.arange(t["rows"]), heads).numpy()
        return file_rows(t["kind"], t["cols"], np.asarray(data).reshape(t["rows"], -1), order)

    def _bytes(self, name: str) -> tuple[dict, np.ndarray]:
        t, expert = self._where[name]
        data = np.memmap(self._path, dtype=np.uint8, mode="r", offset=t["offset"], shape=(t["nbytes"],))
        if expert is not None:
            data = data.reshape(t["experts"], -1)[expert]             # an expert's rows lie together
        return t, data


def read_quantized(index: dict, cfg: dict) -> QuantizedTensors:
    """The indexed file's quantized tensors by HF name, read when asked for."""
    return QuantizedTensors(index, cfg)
