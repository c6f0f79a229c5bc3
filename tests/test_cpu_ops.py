"""The fused C kernels of the quantized decode path against torch references, and the
property they exist for: a row's results do not depend on the other rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verifier import cpu_ops
from verifier.batch import SeqInput
from verifier.cpu_forward import row_plan
from verifier.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the fused CPU kernels")
G = torch.Generator().manual_seed(0)


def _bf(*shape):
    return torch.randn(*shape, generator=G).to(torch.bfloat16)


def test_add_rms_norm_matches_torch():
    x, y, w = torch.randn(5, 64, generator=G), _bf(5, 64), torch.rand(64, generator=G) + 0.5
    summed = x + y.float()
    got = torch.empty(5, 64, dtype=torch.bfloat16)
    cpu_ops.add_rms_norm(x, y, w, 1e-5, got)
    torch.testing.assert_close(x, summed)                                # x was updated in place
    torch.testing.assert_close(got.float(), F.rms_norm(summed, (64,), w, 1e-5), rtol=1e-2, atol=1e-2)
    rows = torch.tensor([3, 0])
    torch.testing.assert_close(cpu_ops.rms_norm_rows(x, rows, w, 1e-5), F.rms_norm(summed[rows], (64,), w, 1e-5))


def test_silu_mul_matches_torch():
    gu = _bf(3, 2 * 40) * 4
    g, u = gu.float().chunk(2, -1)
    out = torch.empty(3, 40, dtype=torch.bfloat16)
    cpu_ops.silu_mul(gu, out)
    torch.testing.assert_close(out.float(), F.silu(g) * u, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rope_store_rotates_and_writes_the_cache(d):
    nh, nkv, rows = 4, 2, 3
    qkv, bias = _bf(rows, (nh + 2 * nkv) * d), torch.randn((nh + 2 * nkv) * d, generator=G)
    cos, sin = torch.randn(50, d, generator=G), torch.randn(50, d, generator=G)
    pos, slots = torch.tensor([7, 30, 2]), torch.tensor([5, 0, 9])
    kc, vc = torch.zeros(12, nkv, d), torch.zeros(12, nkv, d)
    q = torch.empty(rows, nh, d)
    cpu_ops.rope_store(qkv, bias, cos, sin, pos, slots, kc, vc, q)
    x = (qkv.float() + bias).view(rows, nh + 2 * nkv, d)
    rot = apply_rotary(x[:, :nh + nkv], cos[pos][:, None], sin[pos][:, None])
    torch.testing.assert_close(q, rot[:, :nh], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc[slots], rot[:, nh:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc[slots], x[:, nh + nkv:])


def _dense_attention(q, kc, vc, seq: SeqInput, block: int, scale: float):
    """Reference: every row over its sequence's keys, masked, in fp32."""
    slots = [seq.block_table[p // block] * block + p % block for p in range(seq.kv_len)]
    k, v = kc[slots], vc[slots]                                 # [N, NKV, D]
    new = seq.mask if seq.mask is not None else torch.ones(seq.num_new, seq.num_new, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(seq.num_new, seq.ctx_len, dtype=torch.bool), new], 1)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,nhd->htn", q, k) * scale
    return torch.einsum("htn,nhd->thd", s.masked_fill(~mask, float("-inf")).softmax(-1), v).flatten(1)


@pytest.mark.parametrize("d", [16, 64])
def test_attention_matches_a_dense_reference_for_chains_trees_and_batches(d):
    block, nh, nkv = 4, 6, 2
    kc, vc = torch.randn(64, nkv, d, generator=G), torch.randn(64, nkv, d, generator=G)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    seqs = [SeqInput([1], 13, [3, 0, 7, 5]),                                   # decode, scattered blocks
            SeqInput([1, 2, 3, 4], 9, [1, 2, 4, 10], mask=tree, logits_indices=list(range(4))),
            SeqInput([1, 2, 3], 2, [6, 8])]                                     # causal chain
    plan = row_plan(seqs, block)
    q = torch.randn(8, nh, d, generator=G)
    got = torch.empty(8, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(q, kc, vc, plan, block, d ** -0.5, got)
    got = got.float()
    row = 0
    for s in seqs:
        want = _dense_attention(q[row:row + s.num_new], kc, vc, s, block, d ** -0.5)
        torch.testing.assert_close(got[row:row + s.num_new], want, rtol=1e-2, atol=1e-2)
        row += s.num_new


def test_a_tree_node_attends_exactly_like_the_same_token_decoded_after_its_ancestors():
    """Node 3 of a tree (ancestors 0 and 1, sibling 2 masked) against a decode of the same
    token whose ancestors are in the cache: the same keys in the same order, so the same bits."""
    block, nh, nkv, d = 4, 4, 2, 64
    kc, vc = torch.randn(64, nkv, d, generator=G), torch.randn(64, nkv, d, generator=G)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    table = [2, 5, 9, 11, 13]
    q = torch.randn(4, nh, d, generator=G)
    in_tree = torch.empty(4, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(q, kc, vc, row_plan([SeqInput([0] * 4, 10, table, mask=tree, logits_indices=[0, 1, 2, 3])], block),
                   block, 0.125, in_tree)
    # the decode: ancestors 0 and 1 committed at positions 10 and 11, node 3 at 12
    slot = lambda p: table[p // block] * block + p % block  # noqa: E731
    kc2, vc2 = kc.clone(), vc.clone()
    for dst, src in ((12, 13),):              # node 3's k/v move to position 12 (node 2's slot)
        kc2[slot(dst)], vc2[slot(dst)] = kc[slot(src)], vc[slot(src)]
    alone = torch.empty(1, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(q[3:4], kc2, vc2, row_plan([SeqInput([0], 12, table)], block), block, 0.125, alone)
    assert torch.equal(in_tree[3], alone[0])
