"""Reference attention over the paged KV cache, in plain torch (the CPU backend).

Sequences with many new tokens (prefill chunks) run one at a time so that no padding
is wasted; the rest (decode steps, token trees) are padded into one batched call.
Per layer: scatter the new K/V into their slots, gather each sequence's slots
[B, Kmax], and run SDPA under a [B, 1, Qmax, Kmax] boolean mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verifier.attention.base import AttentionBackend, register_backend
from verifier.batch import ForwardBatch, SeqInput
from verifier.kv_cache import slots_for

# Sequences with more new tokens than this attend alone (padding them would waste work).
SOLO_QUERY_LEN = 32


@dataclass
class _Group:
    q_rows: torch.Tensor | slice   # [B, Qmax] rows of the flattened new tokens, or one slice (B=1)
    kv_slots: torch.Tensor         # [B, Kmax] physical slots (padded with 0)
    mask: torch.Tensor             # [B, 1, Qmax, Kmax] bool
    valid: torch.Tensor | None     # [n] flat indices of real (non-padding) rows in B*Qmax


@dataclass
class TorchAttnMeta:
    slot_mapping: torch.Tensor     # [T] physical slot of each new token
    groups: list[_Group]


def new_token_mask(seq: SeqInput) -> torch.Tensor:
    """[q, kv_len] bool: the whole cached prefix, then the new-token mask (causal by default)."""
    q = seq.num_new
    prefix = torch.ones(q, seq.ctx_len, dtype=torch.bool)
    new = seq.mask if seq.mask is not None else torch.ones(q, q, dtype=torch.bool).tril()
    return torch.cat([prefix, new.to(torch.bool).cpu()], dim=1)


@register_backend("torch")
class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: ForwardBatch, block_size: int, device: torch.device) -> TorchAttnMeta:
        starts, slots, t = [], [], 0
        for seq in batch.seqs:
            starts.append(t)
            slots += slots_for(seq.block_table, seq.ctx_len, seq.kv_len, block_size)
            t += seq.num_new
        solo = [i for i, s in enumerate(batch.seqs) if s.num_new > SOLO_QUERY_LEN]
        padded = [i for i, s in enumerate(batch.seqs) if s.num_new <= SOLO_QUERY_LEN]
        groups = [self._solo_group(batch.seqs[i], starts[i], block_size, device) for i in solo]
        if padded:
            groups.append(self._padded_group([batch.seqs[i] for i in padded],
                                             [starts[i] for i in padded], block_size, device))
        return TorchAttnMeta(torch.tensor(slots, dtype=torch.long, device=device), groups)

    @staticmethod
    def _solo_group(seq: SeqInput, start: int, block_size: int, device) -> _Group:
        kv = torch.tensor(slots_for(seq.block_table, 0, seq.kv_len, block_size), device=device)
        mask = new_token_mask(seq).to(device)[None, None]
        return _Group(slice(start, start + seq.num_new), kv[None], mask, None)

    @staticmethod
    def _padded_group(seqs: list[SeqInput], starts: list[int], block_size: int, device) -> _Group:
        b, qmax, kmax = len(seqs), max(s.num_new for s in seqs), max(s.kv_len for s in seqs)
        q_rows = torch.zeros(b, qmax, dtype=torch.long)
        kv = torch.zeros(b, kmax, dtype=torch.long)
        mask = torch.zeros(b, 1, qmax, kmax, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padding rows see one key so softmax stays finite; dropped later
        valid = []
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            q, n = seq.num_new, seq.kv_len
            q_rows[i, :q] = torch.arange(start, start + q)
            kv[i, :n] = torch.tensor(slots_for(seq.block_table, 0, n, block_size))
            mask[i, 0, :q, :] = False
            mask[i, 0, :q, :n] = new_token_mask(seq)
            valid += range(i * qmax, i * qmax + q)
        return _Group(q_rows.to(device), kv.to(device), mask.to(device),
                      torch.tensor(valid, dtype=torch.long, device=device))

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttnMeta, scale: float):
        kvh, d = k_cache.shape[-2:]
        k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for g in meta.groups:
            self._attend_group(q, k_flat, v_flat, g, out, scale)
        return out

    @staticmethod
    def _attend_group(q, k_flat, v_flat, g: _Group, out, scale):
        h, d = q.shape[-2:]
        qg = q[g.q_rows]                                   # [B, Qmax, H, D] (or [Q, H, D] solo)
        if g.valid is None:
            qg = qg.unsqueeze(0)
        kg = k_flat[g.kv_slots].transpose(1, 2)            # [B, KVH, Kmax, D]
        vg = v_flat[g.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg, vg, attn_mask=g.mask,
                                           scale=scale, enable_gqa=True)  # [B, H, Qmax, D]
        o = o.transpose(1, 2)                              # [B, Qmax, H, D]
        if g.valid is None:
            out[g.q_rows] = o[0]
        else:
            rows = g.q_rows.reshape(-1)[g.valid]
            out[rows] = o.reshape(-1, h, d)[g.valid]
