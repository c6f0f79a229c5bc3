"""The LoRA products as Triton kernels (Punica's BGMV: each row gathers its own adapter's weights):
a dense target on the Triton backend (a CUDA GPU; the CPU under TRITON_INTERPRET=1 in CI).

One projection's adapters are stacked per part (q, k and v of a fused qkv; gate and up; a single
part elsewhere) over every slot, zero-padded to the part's largest rank, with each slot's own rank
beside them (0: that slot leaves the part alone). Two launches per projection: `shrink` (h = x A^T,
every part at once) and `expand` (y += h B^T at each part's columns). Each program reads one row,
in one fixed order, so a row's delta does not depend on the rows beside it (Tercel's row
invariance). Products and sums are fp32 whatever x, y and the weights are held in, as in
`LoraSet.add`.

Imported only where the Triton backend serves adapters: TRITON_INTERPRET must be set before
triton is imported (tests/kernels/test_lora_triton.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from verifier.model.lora_adapter import LoraAdapter

BLOCK_K, BLOCK_N = 64, 64        # input columns per shrink step, output columns per expand program


@dataclass(frozen=True)
class LoraStack:
    """One projection's parts under every slot (slot 0, the base, all zero rank)."""
    a: torch.Tensor         # [parts, slots, R, in]
    bt: torch.Tensor        # [parts, slots, R, N]: N the widest part
    ranks: torch.Tensor     # [parts, slots] int32
    offs: torch.Tensor      # [parts] int32: each part's first output column
    widths: torch.Tensor    # [parts] int32


def build_stacks(adapters: dict[int, LoraAdapter], max_loras: int, device: torch.device,
                 dtype: torch.dtype) -> dict[tuple[int, str], LoraStack]:
    """(layer, projection) -> its stack, for every projection some loaded adapter adapts."""
    keys = {k for adapter in adapters.values() for k in adapter.pairs}
    return {k: _stack({slot: {s.off: s for s in a.pairs.get(k, ())} for slot, a in adapters.items()},
                      max_loras, device, dtype) for k in keys}


def _stack(by_slot, max_loras: int, device: torch.device, dtype: torch.dtype) -> LoraStack:
    parts = {off: seg for segs in by_slot.values() for off, seg in segs.items()}
    offs = sorted(parts)
    rank = max(seg.a.shape[0] for segs in by_slot.values() for seg in segs.values())
    width = max(parts[o].bt.shape[1] for o in offs)
    a = torch.zeros(len(offs), max_loras + 1, rank, parts[offs[0]].a.shape[1], dtype=dtype)
    bt = torch.zeros(len(offs), max_loras + 1, rank, width, dtype=dtype)
    ranks = torch.zeros(len(offs), max_loras + 1, dtype=torch.int32)
    for p, off in enumerate(offs):
        for slot, segs in by_slot.items():
            if off in segs:
                r, n = segs[off].bt.shape
                a[p, slot, :r], bt[p, slot, :r, :n], ranks[p, slot] = segs[off].a, segs[off].bt, r
    widths = torch.tensor([parts[o].bt.shape[1] for o in offs], dtype=torch.int32)
    return LoraStack(a.to(device), bt.to(device), ranks.to(device),
                     torch.tensor(offs, dtype=torch.int32, device=device), widths.to(device))


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, ranks_ptr, h_ptr, IN, R, SLOTS, stride_x, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per (row, part): h[row, part, :rank] = x[row] . A[part, slot, :rank]
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    rank = tl.load(ranks_ptr + part * SLOTS + slot)
    if rank > 0:
        r = tl.arange(0, BLOCK_R)
        a_rows = a_ptr + ((part * SLOTS + slot) * R + r[:, None]) * IN
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + row * stride_x + k, mask=k < IN, other=0.0).to(tl.float32)
            av = tl.load(a_rows + k[None, :], mask=(r[:, None] < rank) & (k[None, :] < IN), other=0.0)
            acc += av.to(tl.float32) * xv[None, :]
        tl.store(h_ptr + row * stride_h + part * R + r, tl.sum(acc, axis=1), mask=r < rank)


@triton.jit
def _expand_kernel(h_ptr, bt_ptr, slots_ptr, ranks_ptr, offs_ptr, widths_ptr, y_ptr, R, N, SLOTS,
                   stride_h, stride_y, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per (row, part, block of the part's columns): y[row, off + n] += h . B^T[:, n]
    row, part, nb = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    rank = tl.load(ranks_ptr + part * SLOTS + slot)
    width = tl.load(widths_ptr + part)
    if rank > 0:
        if nb * BLOCK_N < width:
            r = tl.arange(0, BLOCK_R)
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            hv = tl.load(h_ptr + row * stride_h + part * R + r, mask=r < rank, other=0.0)
            bv = tl.load(bt_ptr + ((part * SLOTS + slot) * R + r[:, None]) * N + n[None, :],
                         mask=(r[:, None] < rank) & (n[None, :] < width), other=0.0)
            delta = tl.sum(hv[:, None] * bv.to(tl.float32), axis=0)
            dst = y_ptr + row * stride_y + tl.load(offs_ptr + part) + n
            yv = tl.load(dst, mask=n < width, other=0.0).to(tl.float32)
            tl.store(dst, (yv + delta).to(dst.dtype.element_ty), mask=n < width)


def lora_add(stack: LoraStack, slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """y[t] += each part's (x[t] A^T) B^T under slot slots[t], in place (rows of slot 0 untouched).
    x [T, in] and y [T, out] with contiguous rows, slots [T] int on their device."""
    parts, n_slots, rank, width = stack.bt.shape
    t, d_in = x.shape
    assert x.stride(1) == 1 and y.stride(1) == 1 and slots.shape == (t,), (x.stride(), y.stride(), slots.shape)
    assert stack.a.shape[3] == d_in and x.device == y.device == slots.device == stack.a.device
    if t == 0:
        return
    h = torch.empty(t, parts, rank, dtype=torch.float32, device=x.device)
    block_r = max(triton.next_power_of_2(rank), 16)
    _shrink_kernel[(t, parts)](x, stack.a, slots, stack.ranks, h, d_in, rank, n_slots, x.stride(0),
                               parts * rank, BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    _expand_kernel[(t, parts, triton.cdiv(width, BLOCK_N))](
        h, stack.bt, slots, stack.ranks, stack.offs, stack.widths, y, rank, width, n_slots,
        parts * rank, y.stride(0), BLOCK_R=block_r, BLOCK_N=BLOCK_N)
