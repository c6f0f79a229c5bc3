"""Triton kernels over the paged KV cache: store new K/V, paged tree attention, tree commit.

Cache layout (verifier/attention/kv_cache.py), per layer: [num_blocks, block_size, KVH, D]; the
token at logical position p of a sequence lives at block block_table[p // bs], offset
p % bs ("slot" block * bs + offset of the flattened pool). The kernels address the cache
through its strides, with the last dim contiguous.

Attention: the queries are each sequence's new tokens (ragged; new token i sits at
logical position ctx_len + i). Token i attends to all ctx_len cached tokens of its
sequence plus the new tokens j its mask allows: j <= i for causal sequences (prefill
chunks, decode steps), or mask[i, j] for trees (the ancestor mask). The new tokens' K/V
are read back from the cache, so `write_kv` must run first (the backend does both).

Under TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors;
that is how CI tests them. Two interpreter limits shape this file: its tl.dot multiplies
bf16 operands as their raw uint16 bits, so bf16 is only checked on a GPU (the CPU tests
use fp32); and a scalar bool &-ed into a block mask becomes an integer array there, which
tl.load rejects as a mask, so masks are built from block comparisons only and per-sequence
flags branch with `if` instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from verifier.attention.paged_meta import PagedAttnMeta

LOG2E = 1.4426950408889634


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, ndim: int) -> None:
    assert k_cache.dim() == ndim and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share strides"
    assert k_cache.stride(-1) == 1, "cache head dim must be contiguous"
    assert k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device


# ----------------------------------------------------------------------------- write_kv

@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    # One program per new token: its [KVH, D] of K and of V go to one slot.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


# Decided when the @triton.jit decorators ran (TRITON_INTERPRET=1 at import time or not).
INTERPRETED = not isinstance(_write_kv_kernel, triton.runtime.JITFunction)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] (any token/head strides, D contiguous); caches: [num_blocks, bs, KVH, D];
    slot_mapping: [T] int, every slot valid. Stores token t at slot slot_mapping[t]."""
    _check_cache(k_cache, v_cache, 4)
    t, kvh, d = k.shape
    assert v.shape == k.shape and tuple(k_cache.shape[2:]) == (kvh, d), (k.shape, v.shape, k_cache.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v head dim must be contiguous"
    assert k.dtype == v.dtype == k_cache.dtype, (k.dtype, v.dtype, k_cache.dtype)
    assert slot_mapping.shape == (t,) and not slot_mapping.is_floating_point(), slot_mapping.shape
    assert k.device == k_cache.device == slot_mapping.device
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d), PAGE=k_cache.shape[1])


# ----------------------------------------------------------------------------- attention

@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits +-1 where e^2x overflows or vanishes
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, pos, key_ok, visible,
                 kv_head, qk_scale, stride_cb, stride_cs, stride_ch, d, d_ok,
                 PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, CAP_LOG2: tl.constexpr):
    """One online-softmax step of a [BLOCK_M] query tile over BLOCK_N keys at logical
    positions `pos` (gathered through the block table); `visible` is [BLOCK_M, BLOCK_N].
    CAP_LOG2 > 0: scores soft-capped at that (the cap in log2 units), as Gemma 2's are."""
    blk = tl.load(bt_row + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    kv_off = blk * stride_cb + (pos % PAGE) * stride_cs + kv_head * stride_ch       # [BLOCK_N]
    k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                mask=key_ok[None, :] & d_ok[:, None], other=0.0)                  # [BLOCK_D, BLOCK_N]
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)                  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale                  # [BLOCK_M, BLOCK_N], log2 units
    if CAP_LOG2 > 0:
        qk = _tanh(qk / CAP_LOG2) * CAP_LOG2
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_tree_attn_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, ctx_lens_ptr, tok_seq_ptr, n_new_ptr, anc_offsets_ptr, anc_ptr, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WINDOW: tl.constexpr, CAP_LOG2: tl.constexpr):
    # grid = (new tokens, KVH): one token's GROUP query heads sharing kv head `kv_head` (rows
    # past GROUP are padding). Its keys are numbered k = 0 .. ctx + n_new - 1: the cached
    # prefix, then the new tokens it sees in index order, so a tree node at depth d walks the
    # same keys, in the same BLOCK_N tiles from key 0, as the token decoded alone after its
    # ancestors were committed: the same bits (docs/design.md, exactness on CUDA).
    # WINDOW > 0 (a sliding layer): key k sits at position k (the prefix, then the ancestors in
    # depth order), so the row sees keys >= total - WINDOW; the tiles wholly below are skipped,
    # which leaves m, l and acc as masking them would.
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.load(tok_seq_ptr + t)
    ctx = tl.load(ctx_lens_ptr + s)
    total = ctx + tl.load(n_new_ptr + t)
    anc_off = tl.load(anc_offsets_ptr + t)
    bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt

    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP
    head = kv_head * GROUP + r
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = t.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(total - WINDOW, 0)
    for k0 in range(lo // BLOCK_N * BLOCK_N, total, BLOCK_N):
        key = k0 + tl.arange(0, BLOCK_N)
        key_ok = key < total
        if anc_off < 0:
            pos = key                                   # causal: new key e is new token e, at ctx + e
        else:
            a = tl.load(anc_ptr + anc_off + (key - ctx), mask=key_ok & (key >= ctx), other=0)
            pos = tl.where(key < ctx, key, ctx + a)     # logical position of the key in the sequence
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, pos, key_ok,
                                     (key_ok & (key >= lo))[None, :], kv_head, qk_scale, stride_cb, stride_cs,
                                     stride_ch, d, d_ok, PAGE, DOT_PRECISION, CAP_LOG2)

    # A row that sees nothing (only possible with an all-False mask row and ctx == 0) gives 0.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = t.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: PagedAttnMeta, scale: float, block_n: int = 64, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D] new-token queries (sequence order, D contiguous); caches: [num_blocks, bs,
    KVH, D] already holding the new tokens' K/V. Returns out [T, H, D] (q's dtype, contiguous).
    The tile sizes depend on the model alone (never on the batch), so a row's bits do not.
    `window`: each row sees its last `window` keys only; `softcap`: scores capped (Gemma)."""
    _check_cache(k_cache, v_cache, 4)
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    assert h % kvh == 0, f"{h} query heads over {kvh} kv heads"
    assert tuple(k_cache.shape[1:]) == (meta.block_size, kvh, d), (k_cache.shape, meta.block_size, d)
    assert q.stride(-1) == 1 and q.dtype == k_cache.dtype and q.device == k_cache.device
    assert t == sum(meta.q_lens), f"q has {t} tokens, meta plans {sum(meta.q_lens)}"
    bt = meta.block_tables
    assert bt.dtype == torch.int32 and bt.dim() == 2 and bt.stride(1) == 1 and bt.device == q.device
    assert meta.anc.dtype == torch.int32 and meta.anc_offsets.dtype == torch.int64
    group = h // kvh
    assert block_n >= 16, block_n
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _paged_tree_attn_kernel[(t, kvh)](
        out, q, k_cache, v_cache,
        bt, meta.ctx_lens, meta.tok_seq, meta.n_new, meta.anc_offsets, meta.anc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, PAGE=meta.block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=window or 0, CAP_LOG2=softcap * LOG2E if softcap else 0.0)
    return out


# ----------------------------------------------------------------------------- commit

@triton.jit
def _copy_slots_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_slot_ptr, dst_slot_ptr,
                       s_stride_l, s_stride_b, s_stride_s, s_stride_h,
                       d_stride_l, d_stride_b, d_stride_s, d_stride_h,
                       SRC_PAGE: tl.constexpr, DST_PAGE: tl.constexpr,
                       NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # grid = (pairs, layers): copy K and V [KVH, D] of one slot in one layer.
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_slot_ptr + i).to(tl.int64)
    dst = tl.load(dst_slot_ptr + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    s_off = layer * s_stride_l + (src // SRC_PAGE) * s_stride_b + (src % SRC_PAGE) * s_stride_s + h * s_stride_h + d
    d_off = layer * d_stride_l + (dst // DST_PAGE) * d_stride_b + (dst % DST_PAGE) * d_stride_s + h * d_stride_h + d
    tl.store(dst_k_ptr + d_off, tl.load(src_k_ptr + s_off, mask=ok), mask=ok)
    tl.store(dst_v_ptr + d_off, tl.load(src_v_ptr + s_off, mask=ok), mask=ok)


def _launch_copy(src_k, src_v, dst_k, dst_v, src_slots, dst_slots):
    n, layers, kvh, d = src_slots.numel(), src_k.shape[0], src_k.shape[3], src_k.shape[4]
    _copy_slots_kernel[(n, layers)](
        src_k, src_v, dst_k, dst_v, src_slots, dst_slots,
        *src_k.stride()[:4], *dst_k.stride()[:4],
        SRC_PAGE=src_k.shape[2], DST_PAGE=dst_k.shape[2], NUM_KV_HEADS=kvh, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d))


def _commit_args(k_cache, v_cache, src_slots, dst_slots):
    if k_cache.dim() == 4:  # one layer: view it as a one-layer stack
        k_cache, v_cache = k_cache.unsqueeze(0), v_cache.unsqueeze(0)
    _check_cache(k_cache, v_cache, 5)
    dev = k_cache.device
    src = torch.as_tensor(src_slots, dtype=torch.int64, device=dev).reshape(-1)
    dst = torch.as_tensor(dst_slots, dtype=torch.int64, device=dev).reshape(-1)
    assert src.shape == dst.shape, (src.shape, dst.shape)
    return k_cache, v_cache, src, dst


def commit_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots, dst_slots) -> None:
    """For every layer, cache[dst_slots[i]] = old cache[src_slots[i]] for K and V.

    Caches: all layers [L, num_blocks, bs, KVH, D] (one launch pair for the whole model) or
    one layer [num_blocks, bs, KVH, D]. Slots: int tensors or lists, [N]; dst slots distinct.
    Sources and destinations may overlap (src=[5, 7, 9], dst=[5, 6, 7]): copies of different
    pairs run in parallel, so all sources are first gathered into a temporary [L, N, KVH, D]
    and only a second launch (ordered after the first on the stream) scatters them."""
    k_cache, v_cache, src, dst = _commit_args(k_cache, v_cache, src_slots, dst_slots)
    n = src.numel()
    if n == 0:
        return
    layers, _, _, kvh, d = k_cache.shape
    tmp_k = torch.empty(layers, n, 1, kvh, d, dtype=k_cache.dtype, device=k_cache.device)
    tmp_v = torch.empty_like(tmp_k)
    rows = torch.arange(n, dtype=torch.int64, device=k_cache.device)  # temp slot i = row i (page 1)
    _launch_copy(k_cache, v_cache, tmp_k, tmp_v, src, rows)
    _launch_copy(tmp_k, tmp_v, k_cache, v_cache, rows, dst)
