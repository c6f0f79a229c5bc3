"""Modules over quantized weights: `QuantLinear` (CPU matmuls), `QuantEmbedding`, `RescoredHead`.

A QuantLinear can run a matmul six ways ("paths"):
    int4   torch's `_weight_int4pack_mm_for_cpu` on the packed weight (bf16 activations)
    q4x16  Tercel's int4 kernel (csrc/q4_matmul.c): the same weights against activations
           quantized to 15-bit integers, whose extra rows cost a fraction of torch's
    int8   torch's `_weight_int8pack_mm`, one scale per output channel (bf16 activations)
    q8x16  Tercel's kernel for int8 weights in groups of 16 or 32 (csrc/q8_matmul.c): GGUF's
           Q5_0, Q6_K and Q8_0 blocks as stored, held in 5, 6 or 8 bits; the only kernel for
           such weights (torch's int8 kernel would need them requantized per channel)
    bf16   oneDNN over a dense bf16 copy of the same weights, packed once
    fp32   oneDNN over a dense fp32 copy
Its own kernels (int4 and q4x16, or int8) give each row the same bits whether the row is
alone or among others: sampled rows (decode steps, tree nodes) always take the one the
`KernelPlan` chose at load (`own`). The dense copies are there for prompt rows, where they
are faster: `run_planned` serves them on the plan's path, in fixed tiles (`verifier.quantized.matmul_paths`).
`verifier.quantized.cpu_forward` calls these; the module holds no `forward`. Outputs are bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verifier.cpu import cpu_ops
from verifier.model.linear import onednn_available
from verifier.model.quant import Int4Weight, Int8Weight, QuantWeight, per_channel

_ONEDNN = onednn_available()
# oneDNN packs and multiplies bf16 only with AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; on an
# AVX2-only CPU it refuses to pack bf16 and torch would emulate the products, far below fp32.
DENSE_PATHS = ("bf16", "fp32") if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ("fp32",)
Q4_TILE, Q4_BLOCK = 16, 32      # csrc/q4_matmul.c: output channels per tile, weights per scale
# torch's own bindings of the kernels: a call through torch.ops.aten costs more (figures:
# docs/performance.md, "Matmul paths and quantized kernels").
_INT4_MM = torch._weight_int4pack_mm_for_cpu
_INT8_MM = torch._weight_int8pack_mm
_N_ALIGN = 16          # the int4 packer needs a multiple of 16 output channels


def served_weights(w: QuantWeight) -> QuantWeight:
    """`w` with its scales (and zeros) rounded to bf16, as the kernels hold them."""
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    if isinstance(w, Int4Weight):
        return Int4Weight(w.q, r(w.scale), r(w.zero))
    return Int8Weight(w.q, r(w.scale))


class QuantLinear(nn.Module):
    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, plan):
        super().__init__()
        weight = weight if isinstance(weight, Int4Weight) or q8_offered(weight) else per_channel(weight)
        self.out_features, self.in_features = weight.shape
        self.plan = plan                      # shared by the model's layers; not a submodule
        self.kind = "int4" if isinstance(weight, Int4Weight) else "int8"
        # path -> (kernel, its weight arguments): the row-invariant kernels this weight offers.
        # A plain attribute: a module's buffer lookup costs about a microsecond, and this runs 4
        # times per layer per step. CPU only.
        self._owns: dict[str, tuple] = {}
        if self.kind == "int4":
            self._pack_int4(weight)
        elif weight.group == self.in_features:
            self._pack_int8(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self._dense: dict[str, torch.Tensor] = {}
        # The weights as served (bf16 scales) in unpacked form, kept until the dense copies
        # are made (`release_source`): the packed layout is the kernel's own.
        self._source: QuantWeight | None = served_weights(weight)
        if self.kind == "int4" and q4_offered(weight):
            self.register_buffer("q4", pack_q4(self._source))
            self._owns["q4x16"] = (_q4_mm, (self.q4, self.out_features))
        if self.kind == "int8" and not self._owns:
            self.bits = q8_bits(weight)
            self.register_buffer("q8", pack_q8(self._source))
            self._owns["q8x16"] = (_q8_mm, (self.q8, self.bits, weight.group, self.out_features))
        self.use_own(self.kind if self.kind in self._owns else next(iter(self._owns)))

    def _pack_int4(self, w: Int4Weight) -> None:
        pad = -w.shape[0] % _N_ALIGN
        q, scale, zero = w.q, w.scale, w.zero
        if pad:     # zero rows (scale 0, zero 0) give zero outputs, sliced off after the matmul
            q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, zero))
        self.group = w.group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # [K / group, N, 2] (scale, zero) in bf16: the kernel's layout and dtype
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).transpose(0, 1)
                             .to(torch.bfloat16).contiguous())
        self._owns["int4"] = (_INT4_MM, (self.packed, self.group, self.scale_zero))

    def _pack_int8(self, w: Int8Weight) -> None:
        self.register_buffer("q", w.q.contiguous())
        self.register_buffer("scale", w.scale[:, 0].to(torch.bfloat16).contiguous())   # [N]
        self._owns["int8"] = (_INT8_MM, (self.q, self.scale))

    def own_paths(self) -> tuple[str, ...]:
        return tuple(self._owns)

    def use_own(self, path: str) -> None:
        """Sampled rows take `path` (one of `own_paths`); `drop_other_owns` frees the rest."""
        self.own, self.own_mm = path, self._owns[path]

    def drop_other_owns(self) -> None:
        for path in set(self._owns) - {self.own}:
            for name in _BUFFERS[path]:
                delattr(self, name)
            del self._owns[path]

    # ---- dense copies, for the paths that need them ----------------------------------------
    def add_dense(self, path: str) -> None:
        if path in self._dense:
            return
        if self._source is None:
            raise RuntimeError("dense copies are made at load, before release_source()")
        w = self._source.dequantize()
        w = w if path == "fp32" else w.to(torch.bfloat16)
        self._dense[path] = torch.ops.mkldnn._reorder_linear_weight(w) if _ONEDNN else w

    def release_source(self) -> None:
        self._source = None

    def drop_dense(self, path: str) -> None:
        self._dense.pop(path, None)

    def paths(self) -> tuple[str, ...]:
        return (*self._owns, *self._dense)

    # ---- matmuls --------------------------------------------------------------------------
    def run_planned(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (prompt rows) -> bf16 [M, N] on the plan's path, in calls of exactly
        plan.tile rows (the last padded with zeros): a row then gets the same bits wherever
        it sits, so a prompt's KV does not depend on its chunking or its batch."""
        m, tile = x.shape[0], self.plan.tile
        path = self.plan.bulk if self.plan.bulk in self.paths() else self.own    # another kind's own kernel
        if not tile:
            return self.run(path, x)
        x = F.pad(x, (0, 0, 0, -m % tile))
        return torch.cat([self.run(path, x[i:i + tile]) for i in range(0, m, tile)])[:m]

    def run_own(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [M, K], contiguous -> bf16 [M, N] on the row-invariant kernel the plan chose."""
        return self._run_kernel(self.own_mm, x)

    def _run_kernel(self, kernel: tuple, x: torch.Tensor) -> torch.Tensor:
        op, args = kernel
        y = op(x, *args)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] through one path -> bf16 [M, N]."""
        if path in self._owns:
            return self._run_kernel(self._owns[path], x.to(torch.bfloat16).contiguous())
        m = x.shape[0]
        if m == 1:
            # oneDNN's one-row product (a GEMV) sums in another order than its GEMM, and on
            # some machines (AVX-512 without AMX) a row's bf16 result then differs now and
            # then from the same row inside a larger call: a zero row makes it a GEMM.
            x = F.pad(x, (0, 0, 0, 1))
        if path == "fp32":
            return self._dense_mm(x.float(), self._dense["fp32"]).to(torch.bfloat16)[:m]
        return self._dense_mm(x.to(torch.bfloat16), self._dense["bf16"])[:m]

    @staticmethod
    def _dense_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if _ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
        return F.linear(x, w)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, kind={self.kind}, own={self.own}, "
                f"dense={list(self._dense)}")


_BUFFERS = {"int4": ("packed", "scale_zero"), "q4x16": ("q4",), "int8": ("q", "scale"), "q8x16": ("q8",)}
OWN_PATHS = frozenset(_BUFFERS)     # the weights' own (row-invariant) kernels; the other paths are dense


def _q4_mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_ops.q4_matmul(packed, n, x)


def q4_offered(w: Int4Weight) -> bool:
    """Tercel's int4 kernel takes groups of 32 weights (or multiples) and is built for AVX2 or
    AVX-512 VNNI; elsewhere its scalar code would only be slower than torch's kernel."""
    return w.shape[1] % Q4_BLOCK == 0 and w.group % Q4_BLOCK == 0 and cpu_ops.available() and cpu_ops.q4_isa() > 0


def pack_q4(w: Int4Weight) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 320]: `w` (its scales and zeros in bf16) in the layout
    csrc/q4_matmul.c describes. Per tile of 16 channels and block of 32 weights: 4 groups of 64
    bytes, byte 4 c + e of group g holding channel c's weights 4 g + e (low nibble) and
    16 + 4 g + e (high nibble); then the 16 scales and the 16 zeros."""
    (n, k), per = w.shape, w.group // Q4_BLOCK
    pad = -n % Q4_TILE
    q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (w.q, w.scale, w.zero))  # zero channels
    tiles, blocks = (n + pad) // Q4_TILE, k // Q4_BLOCK
    q = q.to(torch.uint8).view(tiles, Q4_TILE, blocks, 2, 4, 4)     # weight 16 h + 4 g + e of a block
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)

    def per_block(t: torch.Tensor) -> torch.Tensor:      # [N, K / group] -> bytes [tiles, blocks, 32]
        t = t.repeat_interleave(per, 1).to(torch.bfloat16).view(tiles, Q4_TILE, blocks)
        return t.permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([nibbles, per_block(scale), per_block(zero)], -1).contiguous()


def _q8_mm(x: torch.Tensor, packed: torch.Tensor, bits: int, group: int, n: int) -> torch.Tensor:
    return cpu_ops.q8_matmul(packed, bits, group, n, x)


def q8_offered(w: QuantWeight) -> bool:
    """csrc/q8_matmul.c takes int8 weights with a scale per 16 or 32 (GGUF's blocks) and is
    built for AVX2 or AVX-512 VNNI, as q4x16."""
    return (isinstance(w, Int8Weight) and w.group in (16, 32) and w.shape[1] % Q4_BLOCK == 0
            and cpu_ops.available() and cpu_ops.q4_isa() > 0)


def q8_bits(w: Int8Weight) -> int:
    """The fewest bits (5, 6 or 8) that hold every q of `w` (Q5_0: 5, Q6_K: 6, Q8_0: 8)."""
    lo, hi = int(w.q.min()), int(w.q.max())
    return next(b for b in (5, 6, 8) if -(1 << (b - 1)) <= lo and hi < 1 << (b - 1))


def pack_q8(w: Int8Weight) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32, 256 + 64 (bits - 4) + 32 (32 / group)]: `w` (its scales in bf16)
    in the layout csrc/q8_matmul.c describes, u = q + 2^(bits - 1). Per tile of 16 channels and
    block of 32 weights: for 5 and 6 bits u's low nibbles as pack_q4 lays them out and one 64-byte
    plane per higher bit (bit v of byte 4 c + e: the bit of the weight vector v holds there), for
    8 bits the 8 vectors' bytes; then the 16 channels' scales of each group in the block."""
    bits, (n, k) = q8_bits(w), w.shape
    pad = -n % Q4_TILE
    u = F.pad(w.q.to(torch.int32) + (1 << (bits - 1)), (0, 0, 0, pad))     # padded channels: scale 0
    tiles, blocks = (n + pad) // Q4_TILE, k // Q4_BLOCK
    u = u.view(tiles, Q4_TILE, blocks, 2, 4, 4)                 # weight 16 h + 4 g + e of a block
    if bits == 8:                                               # vector v = 4 h + g, byte 4 c + e
        vectors = u.permute(0, 2, 3, 4, 1, 5).reshape(tiles, blocks, 512)
        return torch.cat([vectors, _group_scales(w, tiles, blocks, pad)], -1).to(torch.uint8).contiguous()
    nib = u & 15
    nibbles = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
    vector_bit = (1 << torch.arange(8, dtype=torch.int32)).view(2, 4, 1)      # vector v = 4 h + g
    planes = [(((u >> p) & 1) * vector_bit).sum((3, 4)).permute(0, 2, 1, 3).reshape(tiles, blocks, 64)
              for p in range(4, bits)]
    return torch.cat([nibbles, *planes, _group_scales(w, tiles, blocks, pad)], -1).to(torch.uint8).contiguous()


def _group_scales(w: Int8Weight, tiles: int, blocks: int, pad: int) -> torch.Tensor:
    """bytes [tiles, blocks, 32 per group]: per block the 16 channels' bf16 scales of each of its
    groups (weights 0..15 then 16..31, or all 32)."""
    per = Q4_BLOCK // w.group
    scales = F.pad(w.scale, (0, 0, 0, pad)).to(torch.bfloat16).view(tiles, Q4_TILE, blocks, per)
    return scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, blocks, 32 * per)


class QuantEmbedding(nn.Module):
    """Token embedding over a quantized table: looked-up rows are dequantized to fp32."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self._kind = type(weight)
        self._fields = tuple(weight.__dataclass_fields__)
        for name in self._fields:
            self.register_buffer(name, getattr(weight, name).contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [T] -> [T, hidden] fp32: only the looked-up rows are dequantized
        if self._kind is Int8Weight and ids.device.type == "cpu" and cpu_ops.available():
            return cpu_ops.embed_int8(ids.contiguous(), self.q, self.scale)
        rows = self._kind(*(torch.index_select(getattr(self, f), 0, ids) for f in self._fields))
        return rows.dequantize()


class RescoredHead(nn.Module):
    """The LM head as a fast scan and an exact rescoring.

    The scan runs the whole vocabulary through a quantized kernel (bf16 logits); the
    RESCORE_K highest-scoring tokens of each row then get their logits recomputed in fp32
    from `table`, the file's own head weights (Q8_0 for the default model). The scan only
    picks candidates: on held-out text the exact argmax never ranked below 5th in an int4
    scan, and top-1 agreement with the fp32 model equals that of an exact fp32 head. Every
    step of it works row by row, so a row's logits do not depend on the batch.
    """
    RESCORE_K = 16

    def __init__(self, scan: QuantLinear, table: QuantEmbedding):
        super().__init__()
        self.scan = scan
        self.table = table          # may be the model's embedding module too (tied weights)
        # an int8 table (Q8_0, the default model's) is rescored in one C call
        self._c_rescore = (table._kind is Int8Weight and table.embedding_dim % 8 == 0
                           and (table.embedding_dim // table.scale.shape[1]) % 8 == 0)

    def forward(self, x: torch.Tensor, tokens: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """x [M, hidden] -> logits [M, vocab] fp32. `tokens`: per row, int64 ids whose logits alone
        are needed (a grammar mask that allows few), computed exactly from `table`, the rest
        -inf; None (or a None entry): the whole vocabulary, scanned and rescored. Decode steps
        (verifier/cpu/csrc/decode_loop.cpp, sparse_head) compute the same, row by row."""
        sparse = [] if tokens is None else [i for i, t in enumerate(tokens) if t is not None]
        if not sparse:
            return self._scanned(x)
        logits = torch.full((x.shape[0], self.scan.out_features), float("-inf"))
        dense = [i for i in range(x.shape[0]) if tokens[i] is None]
        if dense:                       # every step of the scan is row by row: the same bits
            logits[dense] = self._scanned(x[dense])
        for i in sparse:
            self._exact(x[i:i + 1], tokens[i].to(torch.int64).view(1, -1), logits[i:i + 1])
        return logits

    def _scanned(self, x: torch.Tensor) -> torch.Tensor:
        logits, top = cpu_ops.scan_topk(self.scan.run(self.scan.own, x), self.RESCORE_K)  # [M, V], [M, k]
        self._exact(x, top, logits)
        return logits

    def _exact(self, x: torch.Tensor, top: torch.Tensor, logits: torch.Tensor) -> None:
        """logits[m, top[m, j]] = x[m] . w[top[m, j]] in fp32, in place (logits contiguous rows)."""
        x = x.float().contiguous()
        if self._c_rescore:
            cpu_ops.rescore_int8(x, top.contiguous(), self.table.q, self.table.scale, logits)
            return
        rows = self.table(top.reshape(-1)).view(*top.shape, self.table.embedding_dim)    # [M, k, hidden]
        logits.scatter_(1, top, (rows * x[:, None, :]).sum(-1))
