"""GGUF's quantized block formats that Tercel serves as stored: one module per format, each
defining FORMAT (`base.BlockFormat`: block size, bytes, the served form, the reader).

Adding a format: a module here beside these, its name in `_MODULES`, and a test that reads
blocks of it (docs/quantization.md, "Adding a format").
"""
from __future__ import annotations

import numpy as np

from verifier.model.gguf_blocks import q4_0, q4_1, q4_k, q5_0, q6_k, q8_0
from verifier.model.gguf_blocks.base import BlockFormat
from verifier.model.quant import Int4KWeight, Int4Weight, QuantWeight

_MODULES = (q4_0, q4_1, q4_k, q5_0, q6_k, q8_0)
FORMATS: dict[str, BlockFormat] = {m.FORMAT.name: m.FORMAT for m in _MODULES}
# the formats the int4 kernels take as stored: a GGUF whose decoder is all of these serves as int4
INT4_NATIVE = frozenset(name for name, f in FORMATS.items() if f.form in (Int4Weight, Int4KWeight))


def read_block_tensor(kind: str, data: np.ndarray, rows: int, cols: int) -> QuantWeight:
    """One quantized tensor (`data`: its raw bytes, [rows, row bytes]) in its served form."""
    fmt = FORMATS[kind]
    return fmt.read(np.asarray(data, dtype=np.uint8).reshape(rows, cols // fmt.weights, fmt.nbytes))
