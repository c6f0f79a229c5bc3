"""The torch attention backend against a dense reference built token by token from the
block table: for gathered (scattered) blocks, and for the view path a lone sequence takes
when its blocks are one contiguous physical range, in order or permuted; 2- and 3-query
steps take the matmul path instead of SDPA (the 3-node tree branches, so its mask matters)."""
import pytest
import torch
import torch.nn.functional as F

from verifier.attention.kv_cache import slots_for
from verifier.attention.torch_backend import TorchBackend, contiguous_range_start, new_token_mask
from verifier.batch import ForwardBatch, SeqInput

H, KVH, D, BS = 6, 2, 16, 4


def reference(seq: SeqInput, q, k_cache, v_cache) -> torch.Tensor:
    """[q, H, D]: SDPA over the sequence's keys in token order (caches already hold the new K/V)."""
    slots = slots_for(seq.block_table, 0, seq.kv_len, BS)
    keys = k_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)    # [S, H, D]
    vals = v_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                       attn_mask=new_token_mask(seq), scale=D ** -0.5)
    return o.transpose(0, 1)


def tree_mask(n: int) -> torch.Tensor:
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def run(table: list[int], ctx: int, new: int, tree: bool):
    gen = torch.Generator().manual_seed(ctx * 31 + new)
    seq = SeqInput([1] * new, ctx, table, mask=tree_mask(new) if tree else None)
    k_cache = torch.randn(40, BS, KVH, D, generator=gen)
    v_cache = torch.randn(40, BS, KVH, D, generator=gen)
    q = torch.randn(new, H, D, generator=gen)
    k, v = torch.randn(new, KVH, D, generator=gen), torch.randn(new, KVH, D, generator=gen)
    backend = TorchBackend()
    meta = backend.plan(ForwardBatch([seq]), BS, torch.device("cpu"))
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D ** -0.5)
    return out, reference(seq, q, k_cache, v_cache), meta.groups[0]


def block_table(layout: str, n: int) -> list[int]:
    run = list(range(7, 7 + n))
    if layout == "permuted":
        return [run[i] for i in torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()]
    if layout == "descending":
        return run[::-1]
    if layout == "scattered":
        return [3 * b + 1 for b in range(n)]
    return run


@pytest.mark.parametrize("layout", ["in order", "permuted", "descending", "scattered"])
@pytest.mark.parametrize("ctx,new,tree", [(29, 1, False), (25, 2, True), (18, 3, True), (22, 7, True),
                                          (0, 37, False), (5, 33, False)])
def test_matches_dense_reference(layout, ctx, new, tree):
    table = block_table(layout, -(-(ctx + new) // BS))
    out, want, group = run(table, ctx, new, tree)
    assert (group.kv_first is not None) == (layout != "scattered")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_contiguous_range_start():
    assert contiguous_range_start([4, 5, 6]) == 4
    assert contiguous_range_start([6, 4, 5]) == 4
    assert contiguous_range_start([4, 6, 7]) is None
    assert contiguous_range_start([4, 4, 5]) is None


def _resident_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_a_cpu_pool_is_zero_and_costs_memory_only_where_written():
    """The KV pool's pages are committed as blocks are first written: an engine's 1 GiB default
    pool costs what its requests used (a test process built dozens of them)."""
    from verifier.attention.kv_cache import KVCache
    before = _resident_mib()
    kv = KVCache(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=4, head_dim=64,
                 dtype=torch.bfloat16, device="cpu")                  # 512 MiB of k and v
    assert _resident_mib() - before < 64
    k0, v0 = kv.layer(0)
    k0[1].fill_(1.0)
    kv.copy_slots([16], [32])                                         # block 1's first slot to block 2's
    assert torch.count_nonzero(kv.k[0, 2, 0]) == 4 * 64 and torch.count_nonzero(kv.k) == 17 * 4 * 64
    assert torch.count_nonzero(kv.v) == 0 and v0.dtype == torch.bfloat16
