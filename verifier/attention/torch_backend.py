"""Reference attention over the paged KV cache, in plain torch (the CPU backend).

Sequences with many new tokens (prefill chunks) run one at a time so that no padding
is wasted; the rest (decode steps, token trees) are padded into one batched call.
Per layer: scatter the new K/V into their slots, gather each sequence's whole blocks
[B, Nblk] (12 KB contiguous copies rather than 768-byte slots: several times faster),
and run SDPA under a [B, 1, Qmax, Nblk * block_size] boolean mask.

A group of one sequence whose blocks are exactly one contiguous physical range, in any
order, skips the gather: SDPA reads the range as a view, and the mask's columns are
permuted into physical order (attention does not depend on key order; RoPE is already
in K). The block manager hands out runs, so this is the usual batch-1 case. At long
contexts the gathers were a sizeable share of a decode step.

A sliding-window layer (Gemma's, `window`) attends under a second set of masks that
`plan(..., window)` builds beside the first: the same keys, those at positions <= p - window
hidden. Soft-capped scores (Gemma 2) go through two matmuls, as SDPA cannot cap them.

Figures and commands: docs/performance.md, "Attention gathers".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifier.attention.base import AttentionBackend
from verifier.attention.kv_cache import slots_for
from verifier.batch import ForwardBatch, SeqInput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

# Sequences with more new tokens than this attend alone (padding them would waste work),
# and so does a single short one.
SOLO_QUERY_LEN = 32
# A lone sequence with this many queries attends through two matmuls instead of SDPA: the
# flash kernel is slow exactly at 2 and 3 queries, slower than at 4 and than the two matmuls
# (figures: docs/performance.md, "Attention gathers"). These are the n-gram drafter's
# one- and two-token verify steps.
MATMUL_QUERY_LENS = (2, 3)


@dataclass
class _Group:
    q_rows: torch.Tensor | slice   # [B, Qmax] rows of the flattened new tokens, or a slice when
                                   # the rows are contiguous (one solo sequence, or B decode steps)
    kv_blocks: torch.Tensor        # [B, Nblk] physical blocks (padded with block 0, masked out)
    mask: torch.Tensor | None      # [B, 1, Qmax, Nblk * block_size] bool ([1, 1, Q, kv_len] with
                                   # kv_len; None when every query sees every key)
    valid: torch.Tensor | None     # [n] flat indices of real (non-padding) rows in B*Qmax; None: no padding
    kv_first: int | None = None    # B == 1 and the blocks are kv_first .. kv_first + Nblk - 1 in
                                   # some order: read that range as a view; mask is in physical order
    kv_len: int | None = None      # with kv_first, blocks in logical order: the keys are the first
                                   # kv_len slots of the range (no padding keys to mask)


@dataclass
class TorchAttnMeta:
    slot_mapping: torch.Tensor     # [T] physical slot of each new token
    groups: list[_Group]
    window_groups: list[_Group] | None = None   # the same under plan's sliding window


def new_token_mask(seq: SeqInput, window: int | None = None) -> torch.Tensor:
    """[q, kv_len] bool: the whole cached prefix, then the new-token mask (causal by default);
    with a window, only keys at positions > the query's position - window (HF's sliding window)."""
    q = seq.num_new
    prefix = torch.ones(q, seq.ctx_len, dtype=torch.bool)
    new = seq.mask if seq.mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
    mask = torch.cat([prefix, new.to(torch.bool).cpu()], dim=1)
    return mask if window is None else mask & in_window(seq, window)


def in_window(seq: SeqInput, window: int) -> torch.Tensor:
    """[q, kv_len] bool: key positions (the prefix's are its slots) > query position - window."""
    pos = torch.tensor(seq.positions if seq.positions is not None else range(seq.ctx_len, seq.kv_len))
    keys = torch.cat([torch.arange(seq.ctx_len), pos])
    return keys[None, :] > pos[:, None] - window


def contiguous_range_start(blocks: list[int]) -> int | None:
    """The first block when `blocks` are exactly one contiguous range in some order, else None."""
    lo = min(blocks)
    if max(blocks) - lo + 1 == len(blocks) and len(set(blocks)) == len(blocks):
        return lo
    return None


def _single(g: _Group, seq: SeqInput, block_size: int, device) -> _Group:
    """Finish a one-sequence group (mask still on the CPU): use the view path when it can."""
    nblk = g.kv_blocks.shape[1]
    first = contiguous_range_start(seq.block_table[:nblk])
    mask, kv_len = g.mask, None
    if first is not None:
        order = [b - first for b in seq.block_table[:nblk]]     # logical block i sits at order[i]
        if order != sorted(order):
            physical = torch.empty_like(mask).view(*mask.shape[:3], nblk, block_size)
            physical[:, :, :, order] = mask.view(*mask.shape[:3], nblk, block_size)
            mask = physical.view_as(mask)
        else:   # in order: read exactly the sequence's keys; a lone query sees them all (unless windowed)
            kv_len = seq.kv_len
            alone = seq.num_new == 1 and bool(mask[..., :kv_len].all())
            mask = None if alone else mask[..., :kv_len].contiguous()
    return _Group(g.q_rows, g.kv_blocks.to(device), None if mask is None else mask.to(device), g.valid,
                  first, kv_len)


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: ForwardBatch, block_size: int, device: torch.device,
             window: int | None = None) -> TorchAttnMeta:
        starts, slots, t = [], [], 0
        for seq in batch.seqs:
            starts.append(t)
            slots += slots_for(seq.block_table, seq.ctx_len, seq.kv_len, block_size)
            t += seq.num_new
        groups = self._groups(batch, starts, block_size, device, None)
        return TorchAttnMeta(torch.tensor(slots, dtype=torch.long, device=device), groups,
                             None if window is None else self._groups(batch, starts, block_size, device, window))

    def _groups(self, batch: ForwardBatch, starts: list[int], block_size: int, device,
                window: int | None) -> list[_Group]:
        solo = [i for i, s in enumerate(batch.seqs) if s.num_new > SOLO_QUERY_LEN]
        padded = [i for i, s in enumerate(batch.seqs) if s.num_new <= SOLO_QUERY_LEN]
        if len(padded) == 1:                 # nothing to pad against: attend alone
            solo, padded = solo + padded, []
        groups = [self._solo_group(batch.seqs[i], starts[i], block_size, device, window) for i in solo]
        if padded:
            groups.append(self._padded_group([batch.seqs[i] for i in padded],
                                             [starts[i] for i in padded], block_size, device, window))
        return groups

    @staticmethod
    def _solo_group(seq: SeqInput, start: int, block_size: int, device, window: int | None = None) -> _Group:
        nblk = _cdiv(seq.kv_len, block_size)
        kv = torch.tensor(seq.block_table[:nblk], device=device)
        mask = torch.zeros(1, 1, seq.num_new, nblk * block_size, dtype=torch.bool)
        mask[0, 0, :, :seq.kv_len] = new_token_mask(seq, window)
        return _single(_Group(slice(start, start + seq.num_new), kv[None], mask, None), seq, block_size, device)

    @staticmethod
    def _padded_group(seqs: list[SeqInput], starts: list[int], block_size: int, device,
                      window: int | None = None) -> _Group:
        b, qmax = len(seqs), max(s.num_new for s in seqs)
        nblk = max(_cdiv(s.kv_len, block_size) for s in seqs)
        q_rows = torch.zeros(b, qmax, dtype=torch.long)
        kv = torch.zeros(b, nblk, dtype=torch.long)
        mask = torch.zeros(b, 1, qmax, nblk * block_size, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padding rows see one key so softmax stays finite; dropped later
        valid = []
        if qmax == 1 and starts == list(range(starts[0], starts[0] + b)):
            # All decode steps, adjacent rows: the query gather and output scatter are views.
            q_rows = slice(starts[0], starts[0] + b)
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            q, n = seq.num_new, seq.kv_len
            if not isinstance(q_rows, slice):
                q_rows[i, :q] = torch.arange(start, start + q)
            used = _cdiv(n, block_size)
            kv[i, :used] = torch.tensor(seq.block_table[:used])
            mask[i, 0, :q, :] = False
            mask[i, 0, :q, :n] = new_token_mask(seq, window)
            valid += range(i * qmax, i * qmax + q)
        if isinstance(q_rows, slice):
            return _Group(q_rows, kv.to(device), mask.to(device), None)
        return _Group(q_rows.to(device), kv.to(device), mask.to(device),
                      torch.tensor(valid, dtype=torch.long, device=device))

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float,
                window: int | None = None, softcap: float | None = None):
        kvh, d = k_cache.shape[-2:]
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        if window is not None and meta.window_groups is None:
            raise ValueError(f"a layer attends within a window of {window}, but plan() was given none")
        out = torch.empty_like(q)
        for g in meta.groups if window is None else meta.window_groups:
            self._attend_group(q, k_cache, v_cache, g, out, scale, softcap)
        return out

    @staticmethod
    def _attend_group(q, k_cache, v_cache, g: _Group, out, scale, softcap: float | None = None):
        h, d = q.shape[-2:]
        b, kvh = g.kv_blocks.shape[0], k_cache.shape[-2]
        if isinstance(g.q_rows, slice):
            # solo: [Q, H, D] -> [1, Q, H, D]; all-decode: [B, H, D] -> [B, 1, H, D]
            qg = q[g.q_rows].unsqueeze(0 if b == 1 else 1)
        else:
            qg = torch.index_select(q, 0, g.q_rows.view(-1)).view(b, -1, h, d)  # [B, Qmax, H, D]
        # [B * Nblk, bs, KVH, D] -> [B, KVH, Nblk * bs, D]; index_select is several times
        # faster than advanced indexing with a 2-D index here (figures: docs/performance.md,
        # "Attention gathers").
        if g.kv_first is not None:
            span = slice(g.kv_first, g.kv_first + g.kv_blocks.shape[1])
            keys = slice(0, g.kv_len)                                   # all slots when kv_len is None
            kg = k_cache[span].view(1, -1, kvh, d)[:, keys].transpose(1, 2)   # [1, KVH, N, D], a view
            vg = v_cache[span].view(1, -1, kvh, d)[:, keys].transpose(1, 2)
        else:
            blocks = g.kv_blocks.view(-1)
            kg = torch.index_select(k_cache, 0, blocks).view(b, -1, kvh, d).transpose(1, 2)
            vg = torch.index_select(v_cache, 0, blocks).view(b, -1, kvh, d).transpose(1, 2)
        if softcap is not None:
            o = _capped_attention(qg, kg, vg, g.mask, scale, softcap)
        elif b == 1 and qg.shape[1] in MATMUL_QUERY_LENS:
            o = _matmul_attention(qg[0], kg[0], vg[0], g.mask[0, 0], scale)[None]
        else:
            o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg, vg, attn_mask=g.mask,
                                               scale=scale, enable_gqa=True).transpose(1, 2)
        # o: [B, Qmax, H, D]
        if g.valid is None:
            out[g.q_rows] = o.reshape(-1, h, d)
        else:
            rows = g.q_rows.reshape(-1)[g.valid]
            out[rows] = o.reshape(-1, h, d)[g.valid]


def _matmul_attention(q, k, v, mask, scale):
    """q [Q, H, D], k/v [KVH, N, D] (views), mask [Q, N] bool -> [Q, H, D].
    Query heads sharing a KV head become rows of one matmul: [KVH, G*Q, D] @ [KVH, D, N]."""
    nq, h, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    qg = q.permute(1, 0, 2).reshape(kvh, g * nq, d)                      # head = kv * g + j
    s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)                # [KVH, G*Q, N]
    s = s.view(kvh, g, nq, -1).masked_fill_(~mask, float("-inf"))
    o = torch.matmul(s.view(kvh, g * nq, -1).softmax(-1), v)             # [KVH, G*Q, D]
    return o.view(h, nq, d).transpose(0, 1)



def _capped_attention(q, k, v, mask, scale, cap):
    """q [B, Q, H, D], k/v [B, KVH, N, D], mask [B, 1, Q, N] bool or None -> [B, Q, H, D], with
    scores soft-capped before the mask as HF's Gemma 2 does: cap * tanh(scores * scale / cap)."""
    b, nq, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.permute(0, 2, 1, 3).reshape(b, kvh, g * nq, d)                # head = kv * g + j
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale                    # [B, KVH, G*Q, N]
    s = torch.tanh(s / cap) * cap
    if mask is not None:
        s = s.view(b, kvh, g, nq, -1).masked_fill(~mask.view(b, 1, 1, nq, -1), float("-inf"))
    p = s.view(b, kvh, g * nq, -1).softmax(-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(p, v)                                               # [B, KVH, G*Q, D]
    return o.view(b, h, nq, d).transpose(1, 2)
