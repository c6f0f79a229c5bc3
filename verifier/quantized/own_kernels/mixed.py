"""Tercel's kernel for a fused projection whose parts a file stores in different formats
(csrc/mixed_matmul.c): each part in its own kernel's layout (q4x16 for int4 groups of 32, q4k for
Q4_K, q8x16 for 5-, 6- and 8-bit groups of 16 or 32), all parts in one call. Without it such a projection
would take one form: its widest part's bits, or its int4 parts requantized to int8."""
import torch

from verifier.model.quant import Int4KWeight, Int4Weight, Int8KWeight, Int8Weight, QuantWeight, StackedWeight
import verifier.quantized.own_kernels.parts as parts
from verifier.quantized.own_kernels.base import OwnKernel, Packed
from verifier.quantized.own_kernels.q4k import KERNEL as Q4K, TABLE_GROUP as Q4K_GROUP
from verifier.quantized.own_kernels.q4x16 import KERNEL as Q4X16
from verifier.quantized.own_kernels.q8x16 import KERNEL as Q8X16, table_group as q8_group

MAX_PARTS = 8       # csrc/mixed_matmul.c's MIXED_PARTS


_PART_KERNELS = {Int4Weight: Q4X16, Int4KWeight: Q4K, Int8Weight: Q8X16, Int8KWeight: Q8X16}


def _kernel(part: QuantWeight) -> OwnKernel:
    return _PART_KERNELS[type(part)]


def _group(part: QuantWeight) -> int:
    """The part's scale group in the kernel's table: 0 for q4x16, 256 for q4k, q8x16's else."""
    if isinstance(part, Int4Weight):
        return 0
    return Q4K_GROUP if isinstance(part, Int4KWeight) else q8_group(part)


def offered(w: QuantWeight) -> bool:
    """Up to MAX_PARTS parts, each one q4x16, q4k or q8x16 takes here."""
    return (isinstance(w, StackedWeight) and len(w.parts) <= MAX_PARTS
            and all(type(p) in _PART_KERNELS and _kernel(p).offered(p) for p in w.parts))


def pack_parts(w: StackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8: the parts' packings by their own kernels, one after another; int64 [P, 3]: each
    part's rows, bits as its kernel holds them (4: q4x16's or q4k's layout) and scale group (`_group`))."""
    packs, table = [], []
    for p in w.parts:
        packed = _kernel(p).pack(p)
        packs.append(packed.args[0].flatten())
        table.append((p.shape[0], packed.bits, _group(p)))
    return torch.cat(packs), torch.tensor(table, dtype=torch.int64)


def pack(w: StackedWeight) -> Packed:
    packed, table = pack_parts(w)
    bits = round(sum(r * b for r, b, _ in table.tolist()) / w.shape[0])
    return Packed((packed, table, w.shape[0]), bits)


KERNEL = OwnKernel("mixed", StackedWeight, offered, pack, parts.mm, parts.loop)
