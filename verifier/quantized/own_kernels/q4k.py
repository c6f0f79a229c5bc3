"""Tercel's kernel for GGUF's Q4_K blocks as stored (csrc/q4k_matmul.c): q4x16's int4 products
under Q4_K's own scales (6-bit scale and min per 32 weights, fp16 d and dmin per 256), 4.625 bits
a weight where the int4 form holds 5, and exact d * sc products where it rounds them to bf16.
It runs as a part of the mixed kernel's runner (table entry: rows, 4 bits, group 256)."""
import torch
import torch.nn.functional as F

from verifier.cpu import cpu_ops
from verifier.model.quant import Int4KWeight, QuantWeight
import verifier.quantized.own_kernels.parts as parts
from verifier.quantized.own_kernels.base import Q4_TILE, OwnKernel, Packed
from verifier.quantized.own_kernels.q4x16 import pack_nibbles

SUPER = Int4KWeight.SUPER
TABLE_GROUP = 256       # csrc/mixed_matmul.c's part group for this layout


def offered(w: QuantWeight) -> bool:
    """Q4_K weights (K a multiple of 256 by the format), on a CPU the kernel is built for."""
    return (isinstance(w, Int4KWeight) and w.shape[1] % SUPER == 0 and w.group == 32
            and cpu_ops.available() and cpu_ops.q4_isa() > 0)


def pack_q4k(w: Int4KWeight) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 256, 2368]: `w` in the layout csrc/q4k_matmul.c describes. Per tile
    of 16 channels and super-block: the channels' d and dmin (fp16), their sc and mn per sub-block
    (bytes, sub-block major), then the 8 sub-blocks' nibbles as q4x16 lays a block's out."""
    (n, k), pad = w.shape, -w.shape[0] % Q4_TILE
    tiles, supers = (n + pad) // Q4_TILE, k // SUPER

    def per_channel(t: torch.Tensor) -> torch.Tensor:      # [N, S * m] -> bytes [tiles, S, 16 * m * size]
        t = F.pad(t, (0, 0, 0, pad)).view(tiles, Q4_TILE, supers, -1)
        return t.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(tiles, supers, -1)
    head = [per_channel(w.d.to(torch.float16)), per_channel(w.dmin.to(torch.float16)),
            per_channel(w.sc.to(torch.uint8)), per_channel(w.mn.to(torch.uint8))]
    nibbles = pack_nibbles(w.q).reshape(tiles, supers, -1)
    return torch.cat([*head, nibbles], -1).contiguous()


def table(w: Int4KWeight) -> tuple[int, int, int]:
    """Its part's entry in the mixed kernel's table."""
    return w.shape[0], 4, TABLE_GROUP


def pack(w: Int4KWeight) -> Packed:
    return Packed((pack_q4k(w), torch.tensor([table(w)], dtype=torch.int64), w.shape[0]), 4)


KERNEL = OwnKernel("q4k", Int4KWeight, offered, pack, parts.mm, parts.loop)
