"""Attention test cases shared by the Triton kernel tests on the CPU (interpreter) and on a
GPU (tests/gpu/): random batches of prefill chunks, decode rows and draft trees."""
from __future__ import annotations

import torch

from verifier.attention.kv_cache import slots_for
from verifier.batch import ForwardBatch, SeqInput


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask (self included) of a random tree: node i's parent is a random earlier node."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_case(specs, h, kvh, d, bs, seed=0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """specs: (kind, ctx_len, num_new) with kind "causal" or "tree". Returns the batch, q/k/v
    as strided views of one fused projection (as the model makes them) and random caches, on
    `device` in `dtype`. Block tables are disjoint chunks of a shuffled pool, so they are
    non-contiguous."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // bs) + 1 for _, c, q in specs]   # one spare block past each sequence
    num_blocks = sum(need) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, at = [], 0
    for (kind, c, q), n in zip(specs, need):
        mask = tree_mask(q, gen) if kind == "tree" else None
        seqs.append(SeqInput([1] * q, c, pool[at:at + n], mask=mask))
        at += n
    t = sum(q for _, _, q in specs)
    to = dict(device=device, dtype=dtype)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(**to)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(**to)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(**to)
    return ForwardBatch(seqs), q, k, v, k_cache, v_cache


def snapshot_commit(cache: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """Commit semantics spelled out: every dst slot gets what its src slot held before the commit."""
    layers, nb, bs, kvh, d = cache.shape
    old, new = cache.reshape(layers, nb * bs, kvh, d).clone(), cache.reshape(layers, nb * bs, kvh, d).clone()
    for s, t in zip(src, dst):
        new[:, t] = old[:, s]
    return new.view(cache.shape)


def decoded_after_commit(run, seq: SeqInput, node: int, q, k, v, k_cache, v_cache) -> torch.Tensor:
    """Tree node `node` of `seq` decoded alone once its ancestors sit, committed, at the positions
    after the prefix: `run(batch, q, k, v, k_cache, v_cache)` -> (out, ...). Returns its [H, D]."""
    ancestors = seq.mask[node].nonzero().flatten().tolist()[:-1]         # in depth order
    bs = k_cache.shape[1]
    kc, vc = k_cache.clone(), v_cache.clone()
    slots = slots_for(seq.block_table, seq.ctx_len, seq.ctx_len + len(ancestors), bs)
    for a, slot in zip(ancestors, slots):
        kc.view(-1, *kc.shape[2:])[slot] = k[a]
        vc.view(-1, *vc.shape[2:])[slot] = v[a]
    alone = ForwardBatch([SeqInput([1], seq.ctx_len + len(ancestors), seq.block_table)])
    one = slice(node, node + 1)
    return run(alone, q[one], k[one], v[one], kc, vc)[0][0]
