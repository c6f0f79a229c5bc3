"""A Linear whose CPU matmul takes the faster library path for each row count.

Thin inputs go through MKL as `W @ x.T` (one row padded to two, because MKL's gemv path is the
slow one), the rest through oneDNN with the weight reordered once into its blocked layout (a copy,
made on first use and redone if the weight changes). Where one path gives way to the other is
timed at load on the model's own matmuls (`verifier.model.linear_tuning`): `onednn_from`, three rows
until a target is tuned (the count first timed, on an AMD EPYC). On CUDA, F.linear in fixed tiles
of rows (verifier/model/row_tiles.py: a row's bits must not depend on the row count); whenever autograd
needs the product, plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verifier.model.row_tiles import in_row_tiles

ONEDNN_MIN_ROWS = 3


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [M, in], weight: [out, in] -> [M, out]
    m = x.shape[0]
    if m == 1:
        y = (weight @ x.repeat(2, 1).t()).t()[:1]     # [out, 2] -> [1, out]
    else:
        y = (weight @ x.t()).t()                      # [out, M] -> [M, out], non-contiguous
    y = y.contiguous()
    return y + bias if bias is not None else y


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = onednn_available()     # asked once: forward runs per layer per token


def onednn_bf16() -> bool:
    """Whether oneDNN packs and multiplies bf16 here (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; on
    an AVX2-only CPU torch would emulate the products, far below fp32)."""
    return _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Linear):
    onednn_from = ONEDNN_MIN_ROWS       # rows from which oneDNN runs; set per model at load
    # A drafter's layer (`for_drafting`): bf16 rows take oneDNN at any count, since a draft's
    # rows need not keep their bits from one row count to another (a target's must).
    bf16_any_rows = False
    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or self._needs_autograd(x):
            return F.linear(x, self.weight, self.bias)
        if x.is_cuda:
            return in_row_tiles(lambda rows: F.linear(rows, self.weight, self.bias), x)
        if x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] >= self.onednn_from and x.dtype == torch.float32 and _ONEDNN:
            return onednn_linear(x, self._packed_weight(), self.bias)
        if self.bf16_any_rows and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return onednn_linear(x, self._packed_weight(), self.bias)
        return cpu_linear(x, self.weight, self.bias)

    def _needs_autograd(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)

    def _packed_weight(self) -> torch.Tensor:
        # Keyed on storage and version so a load_state_dict or in-place update re-packs.
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if self._packed_key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            self._packed_key = key
        return self._packed
