"""Triton kernels (write_kv, paged tree attention, commit_kv) against the torch reference.

They run under TRITON_INTERPRET=1 on CPU tensors, so it is set before triton is imported.
Sizes are tiny: the interpreter runs every program instance in Python.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed, so its kernels cannot be tested")

from verifier.attention import get_backend  # noqa: E402
from verifier.attention import triton_kernels as tk  # noqa: E402
from verifier.attention.kv_cache import KVCache, slots_for  # noqa: E402
from verifier.attention.torch_backend import TorchBackend  # noqa: E402
from verifier.attention.triton_backend import TritonBackend  # noqa: E402
from verifier.batch import ForwardBatch, SeqInput  # noqa: E402
from attention_cases import decoded_after_commit, make_case, snapshot_commit  # noqa: E402

assert tk.INTERPRETED, "triton_kernels was imported before TRITON_INTERPRET=1 was set"

TOL = dict(atol=1e-4, rtol=1e-4)


def run_backend(backend, batch, q, k, v, k_cache, v_cache, **kw):
    """One layer through `backend` on copies of the caches: (out, k_cache, v_cache)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    bs, d = kc.shape[1], kc.shape[-1]
    meta = backend.plan(batch, bs, torch.device("cpu"))
    if kw:
        tk.write_kv(k, v, kc, vc, meta.slot_mapping)
        out = tk.paged_tree_attention(q, kc, vc, meta, d ** -0.5, **kw)
    else:
        out = backend.forward(q, k, v, kc, vc, meta, d ** -0.5)
    return out, kc, vc


def assert_matches_torch(batch, q, k, v, k_cache, v_cache, **kw):
    ref, ref_k, ref_v = run_backend(TorchBackend(), batch, q, k, v, k_cache, v_cache)
    out, out_k, out_v = run_backend(TritonBackend(), batch, q, k, v, k_cache, v_cache, **kw)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out, ref, **TOL)


MIXED = [("causal", 11, 13), ("causal", 23, 1), ("tree", 9, 9), ("causal", 5, 1), ("tree", 0, 6)]


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("h,kvh", [(2, 2), (6, 2), (4, 1)])
def test_mixed_batch_matches_torch(h, kvh, d, bs):
    """A prefill chunk after a prefix, decode steps and random trees in one call match torch (GQA 1/3/4)."""
    assert_matches_torch(*make_case(MIXED, h, kvh, d, bs, seed=h * 100 + d + bs))


def test_multi_tile_loops_match_torch():
    """Several key tiles per row (small tiles), long prefill chunks and trees match torch."""
    case = make_case([("causal", 37, 40), ("tree", 17, 21), ("causal", 50, 1)], 6, 2, 32, 4, seed=7)
    assert_matches_torch(*case, block_n=16)


def test_ctx_len_zero_matches_torch():
    """Sequences with an empty cache (first prefill chunk, lone token, tree) attend only to new tokens."""
    specs = [("causal", 0, 10), ("causal", 0, 1), ("tree", 0, 7)]
    assert_matches_torch(*make_case(specs, 6, 2, 32, 4, seed=3))


def test_non_power_of_two_head_dim_matches_torch():
    """A head dim of 48 (padded to 64 lanes inside the kernel) matches torch."""
    assert_matches_torch(*make_case([("causal", 6, 5), ("tree", 3, 5)], 4, 2, 48, 4, seed=5))


def test_wrong_mask_is_detected():
    """The comparison has teeth: giving the kernel a tree mask with one ancestor dropped mismatches."""
    batch, q, k, v, kc, vc = make_case([("tree", 4, 8)], 4, 2, 32, 4, seed=11)
    seq = batch.seqs[0]
    wrong = seq.mask.clone()
    row = int(wrong.sum(1).argmax())            # a node with at least one ancestor besides itself
    col = int(wrong[row, :row].nonzero()[0])
    wrong[row, col] = False
    bad = ForwardBatch([SeqInput(seq.token_ids, seq.ctx_len, seq.block_table, mask=wrong)])
    ref, _, _ = run_backend(TorchBackend(), batch, q, k, v, kc, vc)
    out, _, _ = run_backend(TritonBackend(), bad, q, k, v, kc, vc)
    assert not torch.allclose(out, ref, **TOL)
    assert torch.allclose(out[:row], ref[:row], **TOL)   # only the edited row and its descendants move


@pytest.mark.parametrize("block_n", [16, 64])
def test_a_tree_node_has_the_bits_of_its_token_decoded_after_its_ancestors(block_n):
    """Row invariance, what T=0 exactness rests on: each node of a tree over a 21-token prefix
    equals, bit for bit, the same token decoded alone after its ancestors were committed."""
    batch, q, k, v, kc, vc = make_case([("tree", 21, 9)], 6, 2, 32, 4, seed=13)
    run = lambda *case: run_backend(TritonBackend(), *case, block_n=block_n)  # noqa: E731
    tree = run(batch, q, k, v, kc, vc)[0]
    for node in range(9):
        assert torch.equal(decoded_after_commit(run, batch.seqs[0], node, q, k, v, kc, vc), tree[node]), node


def test_a_prompt_row_has_the_same_bits_in_any_chunking():
    """A 30-token prompt in one chunk, or as 11 cached tokens and a 19-token chunk: same bits."""
    batch, q, k, v, kc, vc = make_case([("causal", 0, 30)], 6, 2, 32, 4, seed=17)
    whole, kc1, vc1 = run_backend(TritonBackend(), batch, q, k, v, kc, vc, block_n=16)
    table = batch.seqs[0].block_table
    rest = ForwardBatch([SeqInput([1] * 19, 11, table)])
    tail, _, _ = run_backend(TritonBackend(), rest, q[11:], k[11:], v[11:], kc1, vc1, block_n=16)
    assert torch.equal(tail, whole[11:])


def test_write_kv_stores_strided_tokens_at_their_slots():
    """write_kv puts each token's K/V (strided views) at its slot and leaves every other slot alone."""
    gen = torch.Generator().manual_seed(1)
    kvh, d, bs = 3, 32, 4
    kv = torch.randn(5, 2 * kvh * d, generator=gen)
    k, v = (x.view(5, kvh, d) for x in kv.split([kvh * d, kvh * d], dim=-1))
    slots = torch.tensor(slots_for([6, 2, 9], 3, 8, bs))
    kc, vc = torch.randn(10, bs, kvh, d, generator=gen), torch.randn(10, bs, kvh, d, generator=gen)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.view(-1, kvh, d).index_copy_(0, slots, k)
    ref_v.view(-1, kvh, d).index_copy_(0, slots, v)
    tk.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("src,dst", [
    ([5, 7, 9], [5, 6, 7]),              # accepted tree path compacted leftwards (dst <= src)
    ([2, 3, 4], [3, 4, 5]),              # shifted right: every source is another pair's destination
    ([13, 6, 17, 9], [9, 10, 11, 12]),   # across blocks, unordered sources, one source reused as dst
])
def test_commit_kv_with_overlap_matches_torch(src, dst):
    """commit_kv over all layers equals the snapshot semantics and the CPU path (KVCache.copy_slots),
    also when src and dst overlap."""
    gen = torch.Generator().manual_seed(2)
    shape = (3, 6, 4, 2, 32)                    # [L, num_blocks, bs, KVH, D]
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    want_k, want_v = snapshot_commit(k, src, dst), snapshot_commit(v, src, dst)
    cpu = KVCache(*shape, dtype=k.dtype, device="cpu")       # the CPU engine's commit path
    cpu.k.copy_(k), cpu.v.copy_(v)
    cpu.copy_slots(src, dst)
    tk.commit_kv(k, v, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(cpu.k, want_k) and torch.equal(cpu.v, want_v)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_commit_kv_one_layer():
    """commit_kv also takes one layer's [num_blocks, bs, KVH, D] caches and touches nothing else."""
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(5, 4, 2, 32, generator=gen), torch.randn(5, 4, 2, 32, generator=gen)
    want_k, want_v = (snapshot_commit(c[None], [8, 11, 14], [8, 9, 10])[0] for c in (k, v))
    tk.commit_kv(k, v, [8, 11, 14], [8, 9, 10])
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_registry_builds_triton_backend():
    """get_backend("triton") returns the Triton backend."""
    assert isinstance(get_backend("triton"), TritonBackend)
