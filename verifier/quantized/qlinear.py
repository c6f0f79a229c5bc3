"""Modules over quantized weights: `QuantLinear` (CPU matmuls), `QuantEmbedding`, `RescoredHead`.

A QuantLinear runs its matmuls on the weight's own kernels (`verifier.quantized.own_kernels`:
torch's int4 and Tercel's q4x16 for int4 weights, Tercel's q4k for Q4_K ones, torch's int8 and
Tercel's q8x16 for int8 ones), which give each row the same bits whether the row is alone or
among others: every row, prompt rows included, takes the one the `KernelPlan` chose at load
(`own`). It holds the weights in that kernel's packed layout only: no dense copy
(`verifier.quantized.matmul_paths`). `verifier.quantized.cpu_forward` calls these; the module
holds no `forward`. Outputs are bf16."""
from __future__ import annotations

import torch
from torch import nn

from verifier.cpu import cpu_ops
from verifier.model.quant import (Int4KWeight, Int4Weight, Int8KWeight, Int8Weight, KQuantWeight, QuantWeight,
                                  StackedWeight)
from verifier.quantized.own_kernels import KERNELS, kernels_for
from verifier.quantized.own_kernels.base import Packed

def served_weights(w: QuantWeight) -> QuantWeight:
    """`w` with its scales (and zeros) rounded to bf16, as the kernels hold them (Q4_K's and Q6_K's
    own scales are held exactly)."""
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    if isinstance(w, KQuantWeight):
        return w
    if isinstance(w, StackedWeight):
        return StackedWeight(tuple(served_weights(p) for p in w.parts))
    if isinstance(w, Int4Weight):
        return Int4Weight(w.q, r(w.scale), r(w.zero))
    return Int8Weight(w.q, r(w.scale))


_KIND = {Int4Weight: "int4", Int4KWeight: "int4", Int8Weight: "int8", Int8KWeight: "int8", StackedWeight: "mixed"}


class QuantLinear(nn.Module):
    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, plan, own: str | None = None):
        """`own`: pack only that kernel where it takes the weight (the plan's choice, made on
        another layer); None: every kernel that takes it, for the plan to choose among."""
        super().__init__()
        weight, owns = kernels_for(weight)
        if not owns:
            raise ValueError(f"no own kernel takes a {type(weight).__name__} of shape {weight.shape}")
        if own is not None:
            owns = [k for k in owns if k.name == own] or owns[:1]
        served = served_weights(weight)       # bf16 scales, as the kernels hold them; dropped once packed
        self._hold(weight.shape, _KIND[type(weight)], bias, plan, {k.name: k.pack(served) for k in owns})

    @classmethod
    def from_packed(cls, shape: tuple[int, int], bias: torch.Tensor | None, plan, own: str,
                    packed: Packed) -> "QuantLinear":
        """A weight already in kernel `own`'s layout (`own_kernels.from_file`: packed from the file's bytes)."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        form = KERNELS[own].form
        lin._hold(shape, _KIND[form[0] if isinstance(form, tuple) else form], bias, plan, {own: packed})
        return lin

    def _hold(self, shape: tuple[int, int], kind: str, bias: torch.Tensor | None, plan,
              packed: dict[str, Packed]) -> None:
        self.out_features, self.in_features = shape
        self.plan = plan                      # shared by the model's layers; not a submodule
        self.kind = kind
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        # path -> (kernel, its arguments): the row-invariant kernels this weight offers. A plain
        # attribute: a module's buffer lookup costs about a microsecond, and this runs 4 times
        # per layer per step. CPU only.
        self._packed = packed
        self._owns = {name: (KERNELS[name].mm, p.args) for name, p in packed.items()}
        self.use_own(next(iter(packed)))

    @property
    def bits(self) -> int:
        """Bits per weight as the own kernel holds them (Q5_0 on q8x16: 5)."""
        return self._packed[self.own].bits

    def nbytes(self) -> int:
        """Bytes of the packed weights it holds (and its bias)."""
        tensors = [a for p in self._packed.values() for a in p.args if isinstance(a, torch.Tensor)]
        return sum(t.nbytes for t in tensors) + (0 if self.bias is None else self.bias.nbytes)

    def layout(self) -> tuple:
        """What its kernel's split of the work depends on: the kernel, the shapes and dtypes of its
        packed arguments and their other values (group sizes; a mixed projection's row split, in
        int64 tables), never the weights' values."""
        args = tuple(a if not isinstance(a, torch.Tensor) else repr(a.tolist()) if a.dtype == torch.int64
                     else (tuple(a.shape), a.dtype) for a in self._packed[self.own].args)
        return self.own, self.out_features, self.in_features, self.bias is None, args

    def loop_fields(self):
        """The own kernel's entry in the native loop (`verifier.quantized.own_kernels.base.LoopFields`)."""
        return KERNELS[self.own].loop(self._packed[self.own])

    def own_paths(self) -> tuple[str, ...]:
        return tuple(self._owns)

    def use_own(self, path: str) -> None:
        """Every row takes `path` (one of `own_paths`); `drop_other_owns` frees the rest."""
        self.own, self.own_mm = path, self._owns[path]

    def drop_other_owns(self) -> None:
        for path in set(self._owns) - {self.own}:
            del self._owns[path], self._packed[path]

    # ---- matmuls --------------------------------------------------------------------------
    def run_own(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [M, K], contiguous -> bf16 [M, N] on the row-invariant kernel the plan chose."""
        return self._run_kernel(self.own_mm, x)

    def _run_kernel(self, kernel: tuple, x: torch.Tensor) -> torch.Tensor:
        op, args = kernel
        y = op(x, *args)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features].contiguous()

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] through one of its own kernels -> bf16 [M, N]."""
        return self._run_kernel(self._owns[path], x.to(torch.bfloat16).contiguous())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}, own={self.own}"


class QuantEmbedding(nn.Module):
    """Token embedding over a quantized table: looked-up rows are dequantized to fp32. An int4
    table holds its q two to a byte (a 128k-token vocabulary's unpacked q took half a GB)."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        fields = {name: getattr(weight, name) for name in weight.__dataclass_fields__}
        if type(weight) in (Int4Weight, Int4KWeight):
            fields["q"] = fields["q"][:, 0::2] | (fields["q"][:, 1::2] << 4)
        self._hold(type(weight), weight.shape, fields)

    @classmethod
    def from_fields(cls, kind: type, shape: tuple[int, int], fields: dict[str, torch.Tensor]) -> "QuantEmbedding":
        """A table whose fields are already in its form (an int4 kind's q two to a byte:
        `cpu_ops.unpack_q4k_table`, straight from a file's Q4_K blocks)."""
        table = cls.__new__(cls)
        nn.Module.__init__(table)
        table._hold(kind, shape, fields)
        return table

    def _hold(self, kind: type, shape: tuple[int, int], fields: dict[str, torch.Tensor]) -> None:
        self.num_embeddings, self.embedding_dim = shape
        self._kind, self._fields = kind, tuple(fields)
        self._nibbles = kind in (Int4Weight, Int4KWeight)
        for name, t in fields.items():
            self.register_buffer(name, t.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [T] -> [T, hidden] fp32: only the looked-up rows are dequantized
        if self._kind is Int8Weight and ids.device.type == "cpu" and cpu_ops.available():
            return cpu_ops.embed_int8(ids.contiguous(), self.q, self.scale)
        rows = {f: torch.index_select(getattr(self, f), 0, ids) for f in self._fields}
        if self._nibbles:
            rows["q"] = torch.stack([rows["q"] & 15, rows["q"] >> 4], -1).view(len(ids), -1)
        return self._kind(**rows).dequantize()


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
