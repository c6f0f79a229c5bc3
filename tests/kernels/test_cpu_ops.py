"""The fused C kernels of the quantized decode path against torch references, and the
property they exist for: a row's results do not depend on the other rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verifier.batch import SeqInput
from verifier.cpu import cpu_ops
from verifier.model.rope import apply_rotary
from verifier.quantized.attention_tuning import NEVER
from verifier.quantized.cpu_forward import row_plan

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


def test_silu_mul_gives_a_value_the_same_bits_in_any_row_count_and_lane():
    """Rows split among the threads and lanes of a vector width or of the 8-wide tail: each
    element's bits are its own (the decode and prompt rows of one token must agree)."""
    gu = _bf(64, 2 * 104) * 6
    whole = torch.empty(64, 104, dtype=torch.bfloat16)
    cpu_ops.silu_mul(gu, whole)
    for r in (0, 31, 63):
        alone = torch.empty(1, 104, dtype=torch.bfloat16)
        cpu_ops.silu_mul(gu[r:r + 1].contiguous(), alone)
        assert torch.equal(alone.view(torch.int16), whole[r:r + 1].view(torch.int16))
    g, u = gu[0, :104], gu[0, 104:]
    wide = torch.empty(1, 96, dtype=torch.bfloat16)              # the first 96 in full vectors
    cpu_ops.silu_mul(torch.cat([g[8:], u[8:]])[None].contiguous(), wide)
    assert torch.equal(wide[0, 88:].view(torch.int16), whole[0, 96:].view(torch.int16))   # tail lanes there
    assert torch.equal(wide[0, :8].view(torch.int16), whole[0, 8:16].view(torch.int16))


@pytest.mark.parametrize("v", [1000, 1037, 49152])
def test_scan_topk_finds_the_k_largest_and_converts_the_row(v):
    rows, k = 3, 16
    scan = (torch.rand(rows, v, generator=G) * 2 - 1).to(torch.bfloat16)
    planted = torch.stack([torch.randperm(v, generator=G)[:k] for _ in range(rows)])
    planted[0, :2] = torch.tensor([0, v - 1])                   # the first entry and the tail
    scan.scatter_(1, planted, (10 + torch.arange(k, dtype=torch.float32)).to(torch.bfloat16).expand(rows, k))
    out, top = cpu_ops.scan_topk(scan, k)
    assert torch.equal(out, scan.float())
    assert torch.equal(top.sort(-1).values, planted.sort(-1).values)


def test_rescore_int8_writes_the_exact_logits_of_the_candidates_only():
    v, h, g, k = 300, 64, 32, 5
    q = torch.randint(-127, 128, (v, h), generator=G, dtype=torch.int8)
    scale = torch.rand(v, h // g, generator=G)
    x, top = torch.randn(2, h, generator=G), torch.stack([torch.randperm(v, generator=G)[:k] for _ in range(2)])
    logits = torch.full((2, v), -1.0)
    cpu_ops.rescore_int8(x, top, q, scale, logits)
    w = q.float() * scale.repeat_interleave(g, 1)
    want = torch.full((2, v), -1.0).scatter_(1, top, torch.gather(x @ w.T, 1, top))
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rope_store_rotates_and_writes_the_cache(d):
    nh, nkv, rows = 4, 2, 3
    qkv, bias = _bf(rows, (nh + 2 * nkv) * d), torch.randn((nh + 2 * nkv) * d, generator=G)
    cos, sin = torch.randn(50, d, generator=G), torch.randn(50, d, generator=G)
    pos, slots = torch.tensor([7, 30, 2]), torch.tensor([5, 0, 9])
    kc, vc = torch.zeros(12, nkv, d, dtype=torch.bfloat16), torch.zeros(12, nkv, d, dtype=torch.bfloat16)
    q = torch.empty(rows, nh, d)
    cpu_ops.rope_store(qkv, bias, cos, sin, pos, slots, kc, vc, q)
    x = (qkv.float() + bias).view(rows, nh + 2 * nkv, d)
    rot = apply_rotary(x[:, :nh + nkv], cos[pos][:, None], sin[pos][:, None])
    torch.testing.assert_close(q, rot[:, :nh], rtol=1e-5, atol=1e-5)
    # the caches are bf16, rounded to nearest even as torch rounds (k: within one bf16 step, as
    # the fp32 rotation may round its last bit differently)
    torch.testing.assert_close(kc[slots], rot[:, nh:].to(torch.bfloat16), rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(vc[slots], x[:, nh + nkv:].to(torch.bfloat16), rtol=0, atol=0)


_NO_ROPE = torch.zeros(1, 1)


def _heads(nh: int, nkv: int, d: int, scale: float) -> cpu_ops.Heads:
    return cpu_ops.heads(nh, nkv, d, scale, _NO_ROPE, _NO_ROPE)      # attend alone reads no rope table


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


def _tables(lengths: list[int], block: int) -> list[list[int]]:
    """Block tables for sequences of these lengths over one pool, blocks scattered."""
    need = [-(-n // block) for n in lengths]
    perm = torch.randperm(sum(need), generator=G).tolist()
    return [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]


# ctx 600: a row's keys span three chunks of the kernel, merged at the end
@pytest.mark.parametrize("d,ctx", [(16, 0), (64, 0), (64, 600)])
def test_attention_matches_a_dense_reference_for_chains_trees_and_batches(d, ctx):
    block, nh, nkv = 4, 6, 2
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tables = _tables([14 + ctx, 13 + ctx, 5 + ctx], block)
    kc, vc = _bf(sum(map(len, tables)) * block, nkv, d), _bf(sum(map(len, tables)) * block, nkv, d)
    seqs = [SeqInput([1], 13 + ctx, tables[0]),                                # decode
            SeqInput([1, 2, 3, 4], 9 + ctx, tables[1], mask=tree, logits_indices=list(range(4))),
            SeqInput([1, 2, 3], 2 + ctx, tables[2])]                            # causal chain
    q = torch.randn(8, nh, d, generator=G)
    got = torch.empty(8, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(_heads(nh, nkv, d, d ** -0.5), row_plan(seqs, block, nh // nkv), q, kc, vc, got)
    got = got.float()
    row = 0
    for s in seqs:
        want = _dense_attention(q[row:row + s.num_new], kc.float(), vc.float(), s, block, d ** -0.5)
        torch.testing.assert_close(got[row:row + s.num_new], want, rtol=1e-2, atol=1e-2)
        row += s.num_new


@pytest.mark.parametrize("ctx", [10, 610])
@pytest.mark.parametrize("tree_from,decode_from", [(0, NEVER), (NEVER, 0)])
def test_a_tree_node_attends_exactly_like_the_same_token_decoded_after_its_ancestors(ctx, tree_from, decode_from):
    """Node 3 of a tree (ancestors 0 and 1, sibling 2 masked) against a decode of the same
    token whose ancestors are in the cache: the same keys in the same order, so the same bits,
    whether either forward runs on all threads or on one (Heads.parallel_from)."""
    block, nh, nkv, d = 4, 4, 2, 64
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    table = _tables([ctx + 4], block)[0]
    kc, vc = _bf(len(table) * block, nkv, d), _bf(len(table) * block, nkv, d)
    q = torch.randn(4, nh, d, generator=G)
    in_tree = torch.empty(4, nh * d, dtype=torch.bfloat16)
    hd = _heads(nh, nkv, d, 0.125)
    tree_plan = row_plan([SeqInput([0] * 4, ctx, table, mask=tree, logits_indices=[0, 1, 2, 3])], block, nh // nkv)
    hd.parallel_from = tree_from
    cpu_ops.attend(hd, tree_plan, q, kc, vc, in_tree)
    hd.parallel_from = decode_from
    # the decode: ancestors 0 and 1 committed at positions ctx and ctx + 1, node 3 at ctx + 2
    slot = lambda p: table[p // block] * block + p % block  # noqa: E731
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[slot(ctx + 2)], vc2[slot(ctx + 2)] = kc[slot(ctx + 3)], vc[slot(ctx + 3)]   # node 3 into node 2's slot
    alone = torch.empty(1, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(hd, row_plan([SeqInput([0], ctx + 2, table)], block, nh // nkv), q[3:4], kc2, vc2, alone)
    assert torch.equal(in_tree[3], alone[0])


# 70 rows after 300 cached keys cross a chunk of 256 keys mid-prompt; 37 after 0 end mid-group
@pytest.mark.parametrize("d,ctx,n", [(64, 0, 37), (64, 300, 70), (128, 17, 40)])
def test_prompt_rows_match_a_dense_reference_and_leave_the_same_bits_in_any_chunking(d, ctx, n):
    """Prompt rows (Rows.tiles: AMX tiles where this machine has them, see
    cpu_ops.attention_tiles) against the fp32 reference, and bitwise the same whether the
    prompt runs in one call, in three chunks whose later slots still hold garbage (NaN: not
    written yet), or beside another sequence, on all threads or one."""
    block, nh, nkv = 16, 9, 3
    tables = _tables([ctx + n, 50], block)
    kc, vc = _bf(sum(map(len, tables)) * block, nkv, d), _bf(sum(map(len, tables)) * block, nkv, d)
    q = torch.randn(n, nh, d, generator=G)
    hd = _heads(nh, nkv, d, d ** -0.5)
    whole = torch.empty(n, nh * d, dtype=torch.bfloat16)
    cpu_ops.attend(hd, row_plan([SeqInput([1] * n, ctx, tables[0])], block, nh // nkv, prompt=True), q, kc, vc, whole)
    seq = SeqInput([1] * n, ctx, tables[0])
    torch.testing.assert_close(whole.float(), _dense_attention(q, kc.float(), vc.float(), seq, block, d ** -0.5),
                               rtol=1e-2, atol=1e-2)
    slot = lambda p: tables[0][p // block] * block + p % block  # noqa: E731
    for parallel_from in (0, NEVER):
        hd.parallel_from = parallel_from
        chunks = []
        for a, b in ((0, 5), (5, n // 2 + 3), (n // 2 + 3, n)):
            k2, v2 = kc.clone(), vc.clone()
            future = [slot(p) for p in range(ctx + b, ctx + n)]
            k2[future], v2[future] = float("nan"), float("nan")
            out = torch.empty(b - a, nh * d, dtype=torch.bfloat16)
            cpu_ops.attend(hd, row_plan([SeqInput([1] * (b - a), ctx + a, tables[0])], block, nh // nkv, prompt=True),
                           q[a:b].contiguous(), k2, v2, out)
            chunks.append(out)
        assert torch.equal(torch.cat(chunks), whole)
        beside = torch.empty(n + 20, nh * d, dtype=torch.bfloat16)
        pair = [SeqInput([1] * 20, 30, tables[1]), SeqInput([1] * n, ctx, tables[0])]
        cpu_ops.attend(hd, row_plan(pair, block, nh // nkv, prompt=True), torch.cat([torch.randn(20, nh, d), q]),
                       kc, vc, beside)
        assert torch.equal(beside[20:], whole)


def _ints(address: int, n: int) -> list[int]:
    import ctypes
    return list((ctypes.c_int64 * n).from_address(address))


def test_row_plan_gives_each_row_its_position_slot_and_visible_keys():
    """A causal chunk after 20 cached tokens and a 4-node tree after 33, in one plan: every
    row's KV slot, and its key list (the cached prefix then what its mask lets it see), as
    KV slots in logical order."""
    from verifier.attention.kv_cache import slots_for
    bs, chain_table, tree_table = 16, [3, 0, 5], [7, 8, 9]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    seqs = [SeqInput([1, 2, 3], 20, chain_table),
            SeqInput([4, 5, 6, 7], 33, tree_table, positions=[33, 34, 34, 35], mask=mask, logits_indices=[0, 1, 2, 3])]
    plan = row_plan(seqs, bs, group=3)
    assert (plan.rows, plan.longest) == (7, 37)
    assert _ints(plan.pos, 7) == [20, 21, 22, 33, 34, 34, 35]
    assert _ints(plan.slot, 7) == slots_for(chain_table, 20, 23, bs) + slots_for(tree_table, 33, 37, bs)
    count, start = _ints(plan.count, 7), _ints(plan.start, 7)
    lists = [_ints(plan.keys + 8 * s, n) for s, n in zip(start, count)]
    for r in range(3):                         # the chain: its prefix and itself
        assert lists[r] == slots_for(chain_table, 0, 21 + r, bs)
    for r in range(4):                         # the tree: its prefix and its ancestors
        seen = [33 + j for j in range(4) if mask[r, j]]
        assert lists[3 + r] == slots_for(tree_table, 0, 33, bs) + [slots_for(tree_table, p, p + 1, bs)[0] for p in seen]
    first, width = _ints(plan.unit_first, plan.units), _ints(plan.unit_width, plan.units)
    per_unit = cpu_ops.rows_per_unit(3)
    assert sum(width) == 7 and all(w <= per_unit for w in width)
    assert [f + w for f, w in zip(first, width)][:-1] == first[1:]      # units cover the rows in order
    assert 3 in first                                                    # a unit never spans two sequences


def test_argmax_is_torchs_first_maximum_and_refuses_nan():
    g = torch.Generator().manual_seed(1)
    for n in (1, 63, 64, 65, 1000, 49152):
        ties = torch.randint(0, 4, (n,), generator=g).float()
        assert cpu_ops.argmax(ties) == int(ties.argmax())
    row = torch.full((200,), float("-inf"))
    assert cpu_ops.argmax(row) == 0
    row[150] = 1.0
    assert cpu_ops.argmax(row) == 150
    for at in (3, 130, 199):                   # a block, then the tail past the last full block
        bad = torch.randn(200, generator=g)
        bad[at] = float("nan")
        assert cpu_ops.argmax(bad) is None
