"""The Triton kernels on a CUDA GPU against the torch reference in fp32, in fp32, bf16 and fp16.

Run with `make test-gpu` (a process of its own: tests/kernels/test_triton_kernels.py turns the Triton
interpreter on for the CPU). Tolerances, on outputs of unit-variance inputs: fp32 1e-4; bf16
3e-2 (8 mantissa bits: inputs, the P.V product and the output are rounded); fp16 4e-3.
"""

import pytest
import torch

from attention_cases import decoded_after_commit, make_case, snapshot_commit
from verifier.attention.torch_backend import TorchBackend
from verifier.batch import ForwardBatch, SeqInput
from verifier.model.linear import Linear
from verifier.model.llama import RMSNorm

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
MIXED = [("causal", 11, 13), ("causal", 230, 1), ("tree", 90, 9), ("causal", 5, 1), ("tree", 0, 6),
         ("causal", 0, 200)]
CUDA = torch.device("cuda")


def triton_backend():
    """Imported when a test runs: without CUDA this file is only collected, and importing Triton's
    kernels then would fix their mode before tests/kernels/test_triton_kernels.py turns the interpreter on."""
    from verifier.attention.triton_backend import TritonBackend
    return TritonBackend()


def run(backend, batch, q, k, v, k_cache, v_cache):
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = backend.plan(batch, kc.shape[1], CUDA)
    return backend.forward(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5), kc, vc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (32, 8, 128), (4, 1, 32), (14, 2, 64)])
def test_paged_tree_attention_matches_torch(dtype, h, kvh, d):
    batch, q, k, v, kc, vc = make_case(MIXED, h, kvh, d, 16, seed=h + d, device="cuda", dtype=dtype)
    f32 = lambda *ts: [t.float() for t in ts]  # noqa: E731
    ref, ref_k, ref_v = run(TorchBackend(), batch, *f32(q, k, v, kc, vc))
    out, out_k, out_v = run(triton_backend(), batch, q, k, v, kc, vc)
    assert out.dtype == dtype
    assert torch.equal(out_k.float(), ref_k) and torch.equal(out_v.float(), ref_v)   # KV writes are copies
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_kv_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    shape = (4, 6, 16, 2, 64)
    k, v = (torch.randn(shape, generator=gen).to(CUDA, dtype) for _ in range(2))
    src, dst = [13, 6, 17, 9, 40], [9, 10, 11, 12, 13]
    want_k, want_v = snapshot_commit(k, src, dst), snapshot_commit(v, src, dst)
    from verifier.attention import triton_kernels as tk
    tk.commit_kv(k, v, torch.tensor(src, device=CUDA), torch.tensor(dst, device=CUDA))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_tree_rows_and_prompt_chunks_have_the_bits_of_plain_decoding_in_bf16():
    """What T=0 exactness rests on: a tree node equals its token decoded alone after its ancestors
    were committed, and a prompt's rows do not depend on its chunking, bit for bit."""
    batch, q, k, v, kc, vc = make_case([("tree", 300, 12)], 9, 3, 64, 16, seed=3, device="cuda",
                                       dtype=torch.bfloat16)
    one = lambda *case: run(triton_backend(), *case)  # noqa: E731
    tree = one(batch, q, k, v, kc, vc)[0]
    for node in range(12):
        assert torch.equal(decoded_after_commit(one, batch.seqs[0], node, q, k, v, kc, vc), tree[node]), node
    batch, q, k, v, kc, vc = make_case([("causal", 0, 100)], 9, 3, 64, 16, seed=4, device="cuda",
                                       dtype=torch.bfloat16)
    whole, kc1, vc1 = one(batch, q, k, v, kc, vc)
    rest = ForwardBatch([SeqInput([1] * 63, 37, batch.seqs[0].block_table)])
    assert torch.equal(one(rest, q[37:], k[37:], v[37:], kc1, vc1)[0], whole[37:])


@torch.inference_mode()
def test_linear_and_norm_rows_have_the_same_bits_at_any_row_count():
    """A row alone, beside others in 5-, 64- and 130-row calls, anywhere in the call: same bits."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lin = Linear(576, 1536, bias=False).to("cuda", torch.bfloat16)
    norm = RMSNorm(576, 1e-5).to("cuda", torch.bfloat16)
    x = torch.randn(130, 576, generator=gen, device="cuda").to(torch.bfloat16)
    for layer in (lin, norm):
        alone = layer(x[7:8])
        for rows in (x[3:8], x[:64], x[7:71], x):
            at = int((rows == x[7]).all(-1).nonzero()[0])
            assert torch.equal(layer(rows)[at], alone[0]), (type(layer).__name__, len(rows))
