"""Tercel's kernel for int8 weights in groups of 16 or 32 (csrc/q8_matmul.c): GGUF's Q5_0, Q6_K
and Q8_0 blocks as stored, held in 5, 6 or 8 bits, Q6_K with its own int8 scales under a d per
256 (`Int8KWeight`, table group 256); the only kernel for such weights (torch's int8 kernel would
need them requantized per channel). Built for AVX2 or AVX-512 VNNI, as q4x16."""
import torch
import torch.nn.functional as F

from verifier.cpu import cpu_ops
from verifier.model.quant import Int8KWeight, Int8Weight, QuantWeight
from verifier.quantized.own_kernels.base import Q4_BLOCK, Q4_TILE, LoopFields, OwnKernel, Packed
from verifier.quantized.own_kernels.q4x16 import pack_nibbles


SUPER_GROUP = 256       # csrc/q8_matmul.c's group for Q6_K's own scales (Int8KWeight)


def offered(w: QuantWeight) -> bool:
    """Int8 groups of 16 or 32 (one scale per channel goes to torch's kernel), or Q6_K's own
    scales, on a CPU the kernel is built for."""
    grouped = isinstance(w, Int8Weight) and w.group in (16, 32) and w.group != w.shape[1]
    own_scales = isinstance(w, Int8KWeight) and w.group == 16 and w.shape[1] % SUPER_GROUP == 0
    return ((grouped or own_scales) and w.shape[1] % Q4_BLOCK == 0
            and cpu_ops.available() and cpu_ops.q4_isa() > 0)


def table_group(w: Int8Weight | Int8KWeight) -> int:
    """The `group` csrc/q8_matmul.c takes for `w`: its scale group, or 256 for Q6_K's own scales."""
    return SUPER_GROUP if isinstance(w, Int8KWeight) else w.group


def q8_bits(w: Int8Weight | Int8KWeight) -> int:
    """The fewest bits (5, 6 or 8) that hold every q of `w` (Q5_0: 5, Q6_K: 6, Q8_0: 8)."""
    lo, hi = int(w.q.min()), int(w.q.max())
    return next(b for b in (5, 6, 8) if -(1 << (b - 1)) <= lo and hi < 1 << (b - 1))


def pack_q8(w: Int8Weight | Int8KWeight, bits: int | None = None, masks: bool | None = None) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 256 + 64 (bits - 4) + 32 (32 / group)]: `w` (its scales in bf16)
    in the layout csrc/q8_matmul.c describes, u = q + 2^(bits - 1). Per tile of 16 channels and
    block of 32 weights: for 5 and 6 bits u's low nibbles as q4x16's `pack_q4` lays them out and
    64 bytes per higher bit, as planes (bit v of byte 4 c + e: the bit of the weight vector v holds
    there) or as masks (8 bytes per vector v, bit 4 c + e), for 8 bits the 8 vectors' bytes; then
    the 16 channels' scales of each group in the block (Q6_K's own: their int8 sc, and before every
    8 blocks the channels' d in fp16; [tiles, K / 256, 8 * 416 + 32] then). `bits`: `q8_bits(w)`,
    where the caller has it; `masks`: the layout the library reads (`cpu_ops.q8_plane_masks()`)."""
    bits, (n, k) = bits or q8_bits(w), w.shape
    masks = cpu_ops.q8_plane_masks() if masks is None else masks
    pad = -n % Q4_TILE
    # u in 0..255: bytes throughout (int32 took 6x the time: docs/performance.md, "Models of real sizes")
    unpadded = (w.q.view(torch.uint8) + (1 << (bits - 1)) % 256) if w.q.dtype == torch.int8 else \
        (w.q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    u = F.pad(unpadded, (0, 0, 0, pad))                         # padded channels: scale 0
    tiles, blocks = (n + pad) // Q4_TILE, k // Q4_BLOCK
    u = u.view(tiles, Q4_TILE, blocks, 2, 4, 4)                 # weight 16 h + 4 g + e of a block
    if bits == 8:                                               # vector v = 4 h + g, byte 4 c + e
        vectors = u.permute(0, 2, 3, 4, 1, 5).reshape(tiles, blocks, 512)
        return _with_scales(w, vectors, tiles, blocks, pad)
    nibbles = pack_nibbles(unpadded & 15)
    planes = [(_masks if masks else _planes)((u >> p) & 1, tiles, blocks) for p in range(4, bits)]
    return _with_scales(w, torch.cat([nibbles, *planes], -1), tiles, blocks, pad)


def _with_scales(w: Int8Weight | Int8KWeight, weights: torch.Tensor, tiles: int, blocks: int, pad: int):
    """The blocks' weight bytes [tiles, blocks, B] followed by their scales, as uint8."""
    if isinstance(w, Int8Weight):
        return torch.cat([weights, _group_scales(w, tiles, blocks, pad)], -1).to(torch.uint8).contiguous()
    sc = F.pad(w.sc, (0, 0, 0, pad)).view(torch.uint8).view(tiles, Q4_TILE, blocks, 2)    # [.., block, half]
    sc = sc.permute(0, 2, 3, 1).reshape(tiles, blocks, 32)
    blocks_bytes = torch.cat([weights.to(torch.uint8), sc], -1).view(tiles, blocks // 8, -1)
    d = F.pad(w.d, (0, 0, 0, pad)).to(torch.float16).view(tiles, Q4_TILE, blocks // 8)
    d = d.permute(0, 2, 1).contiguous().view(torch.uint8)                   # [tiles, supers, 32]
    return torch.cat([d, blocks_bytes], -1).contiguous()


def _planes(bit: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """bit [tiles, 16 c, blocks, 2 h, 4 g, 4 e] -> bytes [tiles, blocks, 64]: byte 4 c + e, bit v = 4 h + g."""
    vector_bit = (1 << torch.arange(8, dtype=torch.uint8)).view(2, 4, 1)
    return (bit * vector_bit).sum((3, 4), dtype=torch.uint8).permute(0, 2, 1, 3).reshape(tiles, blocks, 64)


def _masks(bit: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """The same bits as 8 little-endian 64-bit masks: mask v = 4 h + g, bit 4 c + e."""
    bit = bit.permute(0, 2, 3, 4, 1, 5).reshape(tiles, blocks, 8, 8, 8)      # [.., v, byte, bit in byte]
    return (bit << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).reshape(tiles, blocks, 64)


def _group_scales(w: Int8Weight, tiles: int, blocks: int, pad: int) -> torch.Tensor:
    """bytes [tiles, blocks, 32 per group]: per block the 16 channels' bf16 scales of each of its
    groups (weights 0..15 then 16..31, or all 32)."""
    per = Q4_BLOCK // w.group
    scales = F.pad(w.scale, (0, 0, 0, pad)).to(torch.bfloat16).view(tiles, Q4_TILE, blocks, per)
    return scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, blocks, 32 * per)


def pack(w: Int8Weight | Int8KWeight) -> Packed:
    bits = q8_bits(w)
    return Packed((pack_q8(w, bits), bits, table_group(w), w.shape[0]), bits)


def _mm(x: torch.Tensor, packed: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    return cpu_ops.q8_matmul(packed, bits, group, n, x)


def loop(p: Packed) -> LoopFields:
    packed, bits, group, _ = p.args
    return LoopFields(32, packed, None, group, bits)


KERNEL = OwnKernel("q8x16", (Int8Weight, Int8KWeight), offered, pack, _mm, loop)
