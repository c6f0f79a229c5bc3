"""The Triton attention kernel's sliding window and score soft-capping (Gemma) against the torch
backend, under TRITON_INTERPRET=1 on CPU tensors (set before triton is imported), and a tiny
Gemma 2 through the Triton backend against HF."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed, so its kernels cannot be tested")

from attention_cases import decoded_after_commit, make_case  # noqa: E402
from verifier.attention import triton_kernels as tk  # noqa: E402
from verifier.attention.torch_backend import TorchBackend  # noqa: E402
from verifier.attention.triton_backend import TritonBackend  # noqa: E402
from verifier.batch import ForwardBatch, SeqInput  # noqa: E402

assert tk.INTERPRETED, "triton_kernels was imported before TRITON_INTERPRET=1 was set"

TOL = dict(atol=1e-4, rtol=1e-4)


def with_tree_positions(batch: ForwardBatch) -> ForwardBatch:
    """Tree nodes at ctx + depth, as the engine places them (a window counts positions)."""
    return ForwardBatch([s if s.mask is None else
                         SeqInput(s.token_ids, s.ctx_len, s.block_table, mask=s.mask,
                                  positions=[s.ctx_len + int(r.sum()) - 1 for r in s.mask]) for s in batch.seqs])


def attend(backend, batch, q, k, v, k_cache, v_cache, window, softcap, block_n=None):
    kc, vc = k_cache.clone(), v_cache.clone()
    d = kc.shape[-1]
    meta = backend.plan(batch, kc.shape[1], torch.device("cpu"), window)
    if block_n:
        tk.write_kv(k, v, kc, vc, meta.slot_mapping)
        return tk.paged_tree_attention(q, kc, vc, meta, d ** -0.5, block_n, window, softcap)
    return backend.forward(q, k, v, kc, vc, meta, d ** -0.5, window, softcap)


CASE = [("causal", 37, 40), ("tree", 17, 21), ("causal", 50, 1), ("causal", 0, 9)]


@pytest.mark.parametrize("window,softcap", [(6, None), (21, None), (None, 1.5), (6, 1.5)])
def test_window_and_softcap_match_torch(window, softcap):
    """Prefill chunks, a decode row and a tree, several key tiles per row: the kernel's window
    (whole tiles below it skipped) and capped scores match the torch backend's masks."""
    batch, q, k, v, kc, vc = make_case(CASE, 6, 2, 32, 4, seed=7)
    batch = with_tree_positions(batch)
    ref = attend(TorchBackend(), batch, q, k, v, kc, vc, window, softcap)
    out = attend(TritonBackend(), batch, q, k, v, kc, vc, window, softcap, block_n=16)
    torch.testing.assert_close(out, ref, **TOL)
    if window:      # and the window mattered
        full = attend(TorchBackend(), batch, q, k, v, kc, vc, None, softcap)
        assert not torch.allclose(full, ref, **TOL)


def test_a_windowed_tree_node_has_the_bits_of_its_token_decoded_after_its_ancestors():
    """Row invariance under a window: a tree node over a 21-token prefix equals, bit for bit,
    the same token decoded alone after its ancestors were committed."""
    batch, q, k, v, kc, vc = make_case([("tree", 21, 9)], 6, 2, 32, 4, seed=13)
    run = lambda *case: (attend(TritonBackend(), *case, 7, 1.5, block_n=16),)  # noqa: E731
    tree = run(batch, q, k, v, kc, vc)[0]
    for node in range(9):
        assert torch.equal(decoded_after_commit(run, batch.seqs[0], node, q, k, v, kc, vc), tree[node]), node


def test_gemma2_through_the_triton_backend_matches_hf(tmp_path):
    """A tiny Gemma 2 (sliding layers, capped scores and logits) served on the Triton backend."""
    from gemma_cases import PROMPT, make_gemma
    from model_cases import hf_logits, own_logits_chunked
    from verifier.target import TargetModel
    d = make_gemma(tmp_path / "gemma2", "gemma2")
    target = TargetModel(str(d), device="cpu", backend="triton", load_tokenizer_files=False)
    ours = own_logits_chunked(target, PROMPT, [20, 1, 1, 7, 8])
    ref = hf_logits(d, PROMPT)
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
