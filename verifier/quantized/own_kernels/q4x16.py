"""Tercel's int4 kernel (csrc/q4_matmul.c): int4 weights against activations quantized to 15-bit
integers, whose extra rows cost a fraction of torch's; built for AVX2 or AVX-512 VNNI."""
import torch
import torch.nn.functional as F

from verifier.cpu import cpu_ops
from verifier.model.quant import Int4Weight, QuantWeight
from verifier.quantized.own_kernels.base import Q4_BLOCK, Q4_TILE, LoopFields, OwnKernel, Packed


def offered(w: QuantWeight) -> bool:
    """Groups of 32 weights (or multiples), on a CPU the kernel is built for; elsewhere its
    scalar code would only be slower than torch's kernel."""
    return w.shape[1] % Q4_BLOCK == 0 and w.group % Q4_BLOCK == 0 and cpu_ops.available() and cpu_ops.q4_isa() > 0


def pack_q4(w: Int4Weight) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 320]: `w` (its scales and zeros in bf16) in the layout
    csrc/q4_matmul.c describes. Per tile of 16 channels and block of 32 weights: 4 groups of 64
    bytes, byte 4 c + e of group g holding channel c's weights 4 g + e (low nibble) and
    16 + 4 g + e (high nibble); then the 16 scales and the 16 zeros."""
    (n, k), per = w.shape, w.group // Q4_BLOCK
    pad = -n % Q4_TILE
    scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (w.scale, w.zero))  # zero channels
    tiles, blocks = (n + pad) // Q4_TILE, k // Q4_BLOCK

    def per_block(t: torch.Tensor) -> torch.Tensor:      # [N, K / group] -> bytes [tiles, blocks, 32]
        t = t.repeat_interleave(per, 1).to(torch.bfloat16).view(tiles, Q4_TILE, blocks)
        return t.permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([pack_nibbles(w.q), per_block(scale), per_block(zero)], -1).contiguous()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 256]: q (0..15, [N, K]) as csrc/q4_nibbles.h lays a block's
    nibbles out, channels past N zero."""
    n, k = q.shape
    q = F.pad(q.to(torch.uint8), (0, 0, 0, -n % Q4_TILE))
    tiles, blocks = q.shape[0] // Q4_TILE, k // Q4_BLOCK
    q = q.view(tiles, Q4_TILE, blocks, 2, 4, 4)     # weight 16 h + 4 g + e of a block
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)


def _mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_ops.q4_matmul(packed, n, x)


def loop(p: Packed) -> LoopFields:
    return LoopFields(16, p.args[0])


KERNEL = OwnKernel("q4x16", Int4Weight, offered, lambda w: Packed((pack_q4(w), w.shape[0]), 4), _mm, loop)
