"""A GGUF's blocks packed straight into an own kernel's layout, without the served form between.

Reading a tensor into its served form (`verifier.model.gguf_blocks`: q unpacked, a byte a weight)
and packing that (`q4x16.pack_q4`, `q4k.pack_q4k`, `q8x16.pack_q8`) passes over the weights
several times in numpy and torch; most of a large model's load went there. csrc/repack.c writes
the same layouts from the file's bytes in one pass: Q4_0 and Q4_1 for q4x16, Q4_K for q4k, Q6_K
for q8x16 (5 or 6 bits, its own scales), and a fused projection whose parts lie in several of
these formats for the mixed kernel. The bytes are the same as packing the served form
(`tests/model/test_model_sizes.py`).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from verifier.cpu import cpu_ops
from verifier.model.gguf_blocks import FORMATS
from verifier.model.gguf_quant import FileRows
from verifier.quantized.own_kernels.base import Q4_TILE, Packed
from verifier.quantized.own_kernels.mixed import MAX_PARTS
from verifier.quantized.own_kernels.q4k import TABLE_GROUP
from verifier.quantized.own_kernels.q8x16 import SUPER_GROUP

_KERNEL = {"Q4_0": "q4x16", "Q4_1": "q4x16", "Q4_K": "q4k", "Q6_K": "q8x16"}
_GROUP = {"q4x16": 0, "q4k": TABLE_GROUP, "q8x16": SUPER_GROUP}    # a part's scale group in the mixed kernel's table


def packed(parts: list[FileRows], mode: str, plan_own: str) -> tuple[str, Packed] | None:
    """(kernel, packing) of the projection whose parts are `parts`, one after another; None where
    csrc/repack.c has no packer for it: a format without one, Q6_K outside mode "gguf" (int4
    requantizes it), a lone Q4_0 / Q4_1 weight the plan put on another kernel, Q4_0 beside Q4_1."""
    if any(p.kind not in _KERNEL or (p.kind == "Q6_K" and mode != "gguf") for p in parts):
        return None
    keyed = [((_KERNEL[p.kind], _bits(p)), p) for p in parts]
    runs = [(bits, [p for _, p in run]) for (_, bits), run in itertools.groupby(keyed, lambda kp: kp[0])]
    if any(len({p.kind for p in run}) > 1 for _, run in runs) or len(runs) > MAX_PARTS:
        return None
    if len(runs) == 1:
        kernel = _KERNEL[parts[0].kind]
        return None if kernel == "q4x16" and plan_own != "q4x16" else (kernel, _pack_run(*runs[0]))
    packs = [_pack_run(*run) for run in runs]
    # each part's rows (its packing's last argument), bits and scale group
    table = torch.tensor([(p.args[-1], p.bits, _GROUP[_KERNEL[run[0].kind]]) for (_, run), p in zip(runs, packs)],
                         dtype=torch.int64)
    rows = int(table[:, 0].sum())
    bits = round(sum(r * b for r, b, _ in table.tolist()) / rows)
    return "mixed", Packed((torch.cat([p.args[0].flatten() for p in packs]), table, rows), bits)


def _bits(p: FileRows) -> int:
    """Q6_K: 5 where every weight of the part fits 5 bits, else 6 (`q8x16.q8_bits`); others 4."""
    if p.kind != "Q6_K":
        return 4
    return 5 if cpu_ops.q6k_fits_5_bits(_addresses([p]), p.cols // FORMATS["Q6_K"].weights) else 6


def _addresses(run: list[FileRows]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([p.address for p in run]))


def _pack_run(bits: int, run: list[FileRows]) -> Packed:
    """Consecutive parts in one format and `bits`, packed as one weight."""
    kind, cols, address = run[0].kind, run[0].cols, _addresses(run)
    rows, tiles = address.shape[0], -(-address.shape[0] // Q4_TILE)
    weights = FORMATS[kind].weights
    if kind in ("Q4_0", "Q4_1"):
        out = torch.empty(tiles, cols // weights, 320, dtype=torch.uint8)
        cpu_ops.repack_q4x16(address, kind == "Q4_1", out)
        return Packed((out, rows), 4)
    if kind == "Q4_K":
        out = torch.empty(tiles, cols // weights, 64 + 256 + 8 * 256, dtype=torch.uint8)
        cpu_ops.repack_q4k(address, out)
        return Packed((out, torch.tensor([[rows, 4, TABLE_GROUP]], dtype=torch.int64), rows), 4)
    out = torch.empty(tiles, cols // weights, 32 + 8 * (256 + 64 * (bits - 4) + 32), dtype=torch.uint8)
    cpu_ops.repack_q6k(address, bits, cpu_ops.q8_plane_masks(), out)
    return Packed((out, bits, SUPER_GROUP, rows), bits)

