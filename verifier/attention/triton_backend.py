"""Triton attention backend: paged tree attention over the KV cache (the CUDA backend).

plan(): the batch's plain ints become PagedAttnMeta once per forward (block tables padded
to [B, max_blocks] int32, ctx_lens, each new token's sequence and how many new tokens it sees,
the tree rows' ancestor lists (-1 for causal rows), and the slot mapping).
forward(), per layer: write_kv stores the new K/V, then paged_tree_attention reads
prefix and new tokens back through the block table. No device sync per layer.

On CPU tensors it runs only under TRITON_INTERPRET=1 set before triton is imported
(how the tests run it); the torch backend is the one that serves on CPU.
"""
from __future__ import annotations

import torch

import verifier.attention.triton_kernels as tk
from verifier.attention.paged_meta import PagedAttnMeta, pack_paged_meta
from verifier.attention.base import AttentionBackend
from verifier.batch import ForwardBatch


class TritonBackend(AttentionBackend):
    name = "triton"

    def plan(self, batch: ForwardBatch, block_size: int, device: torch.device,
             window: int | None = None) -> PagedAttnMeta:
        seqs = batch.seqs
        return pack_paged_meta(
            q_lens=[s.num_new for s in seqs], ctx_lens=[s.ctx_len for s in seqs],
            block_tables=[s.block_table for s in seqs], masks=[s.mask for s in seqs],
            block_size=block_size, device=device)

    def forward(self, q, k, v, k_cache, v_cache, meta: PagedAttnMeta, scale: float,
                window: int | None = None, softcap: float | None = None):
        if q.device.type != "cuda" and not tk.INTERPRETED:
            raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set "
                               "before triton is imported (tests); use the torch backend on CPU")
        # k/v come out of a fused qkv projection: strided views, which both kernels accept.
        tk.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return tk.paged_tree_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
