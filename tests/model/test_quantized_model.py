"""SmolLM2 on its own quantized weights (the default, int4): a decode row's logits do not
depend on what shares its forward, the GGUF's blocks are what is served, the quality gate
holds, and the default configuration is the quantized one."""
from __future__ import annotations

import pytest
import torch

from verifier.attention.kv_cache import slots_for
from verifier.batch import ForwardBatch, SeqInput
from verifier.cpu import cpu_ops
from verifier.target import TargetModel

BLOCK = 16


@pytest.fixture(scope="module")
def int4(smollm2_dir):
    target = TargetModel(str(smollm2_dir), quantization="int4")
    target.allocate_kv(64, BLOCK)
    return target


def _prefill(target, ids: list[int], table: list[int]) -> None:
    target.forward(ForwardBatch([SeqInput(ids, 0, table)]))


def _chain(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_a_row_is_bitwise_the_same_alone_and_inside_2_5_and_8_row_forwards(int4):
    """Sequence A's next token, through the whole forward: alone; beside another sequence's
    decode step (2 rows); as the root of a 5-node chain (5 rows); beside a 7-node tree (8
    rows); beside a prefill chunk (prompt rows, attending on another path). The logits are bitwise equal."""
    a_ids, b_ids, c_ids = list(range(100, 140)), list(range(500, 530)), list(range(900, 1000))
    a, b, c = [0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10, 11, 12]
    _prefill(int4, a_ids, a)
    _prefill(int4, b_ids, b)
    n = len(a_ids)
    alone = int4.forward(ForwardBatch([SeqInput([7], n, a)])).logits[0]
    two = int4.forward(ForwardBatch([SeqInput([9], len(b_ids), b), SeqInput([7], n, a)]))
    assert torch.equal(two.seq_logits(1)[0], alone)
    five = int4.forward(ForwardBatch([SeqInput([7, 8, 9, 10, 11], n, a, mask=_chain(5),
                                               logits_indices=list(range(5)))]))
    assert torch.equal(five.seq_logits(0)[0], alone)
    tree = torch.eye(7, dtype=torch.bool)
    tree[:, 0] = True                                       # a root with six children
    eight = int4.forward(ForwardBatch([SeqInput([7], n, a),
                                       SeqInput(list(range(20, 27)), len(b_ids), b, mask=tree,
                                                logits_indices=list(range(7)))]))
    assert torch.equal(eight.seq_logits(0)[0], alone)
    mixed = int4.forward(ForwardBatch([SeqInput(c_ids, 0, c), SeqInput([7], n, a)]))
    assert torch.equal(mixed.seq_logits(1)[0], alone)


def test_a_prompt_leaves_the_same_kv_and_logits_however_it_is_chunked(int4):
    """One 50-token prompt prefilled in one chunk; after a 16-token prefix hit; in chunks of
    20, 1 and 29 tokens; beside another prompt's prefill; in other KV blocks: the cache holds
    the same bits and the first token's logits are the same."""
    ids, other = list(range(3000, 3050)), SeqInput(list(range(4000, 4040)), 0, [40, 41, 42])

    def run(cuts: list[int], table: list[int], beside: SeqInput | None = None):
        for start, end in zip(cuts, cuts[1:]):
            seq = SeqInput(ids[start:end], start, table, logits_indices=None if end == len(ids) else [])
            out = int4.forward(ForwardBatch(([beside] if beside else []) + [seq]))
        slots = torch.tensor(slots_for(table, 0, len(ids), BLOCK))
        kv = [c.view(c.shape[0], -1, *c.shape[3:])[:, slots] for c in (int4.kv.k, int4.kv.v)]
        return out.seq_logits(1 if beside else 0)[-1], kv

    logits, kv = run([0, 50], [50, 51, 52, 53])
    for cuts, table, beside in (([0, 16, 50], [54, 55, 56, 57], None), ([0, 20, 21, 50], [58, 59, 60, 61], None),
                                ([0, 50], [50, 51, 52, 53], other), ([0, 49, 50], [62, 63, 50, 51], None)):
        got_logits, got_kv = run(cuts, table, beside)
        assert torch.equal(got_logits, logits), cuts
        assert all(torch.equal(a, b) for a, b in zip(got_kv, kv)), cuts


def test_mixed_forward_keeps_batch_order_for_logits_and_hidden_states(int4):
    """Exact rows run first inside the forward; logits and tapped hidden states come back in
    the batch's order (a prefill chunk listed before a decode step)."""
    p_ids, d_ids = list(range(300, 340)), list(range(600, 620))
    p, d = [20, 21, 22], [23, 24]
    _prefill(int4, d_ids, d)
    batch = ForwardBatch([SeqInput(p_ids, 0, p), SeqInput([5], len(d_ids), d)], capture_layers=(3,))
    out = int4.forward(batch)
    alone_p = int4.forward(ForwardBatch([SeqInput(p_ids, 0, p)], capture_layers=(3,)))
    alone_d = int4.forward(ForwardBatch([SeqInput([5], len(d_ids), d)], capture_layers=(3,)))
    assert out.logits_offsets == [0, 1, 2]
    assert torch.equal(out.seq_logits(1), alone_d.logits)
    assert torch.equal(out.hidden[3][len(p_ids)], alone_d.hidden[3][0])
    torch.testing.assert_close(out.hidden[3][:len(p_ids)], alone_p.hidden[3], rtol=0, atol=0)


def test_decode_rows_and_prefill_rows_compute_the_same_model(int4):
    """The exact path (decode and verify rows: int4 kernel, fused C kernels) and the module
    path (prefill rows: the plan's matmul path, torch attention) agree up to bf16 rounding."""
    ids = list(range(2000, 2090))
    table = [30, 31, 32, 33, 34, 35]
    exact = int4.forward(ForwardBatch([SeqInput(ids, 0, table, logits_indices=list(range(len(ids))))])).logits
    prefill = int4.forward(ForwardBatch([SeqInput(ids, 0, table)])).logits
    rel = (exact[-1] - prefill[0]).norm() / prefill[0].norm()
    print(f"last position: relative logit difference {rel:.4f}")
    assert rel < 0.02 and exact[-1].argmax() == prefill[0].argmax()


def test_int4_serves_the_gguf_blocks(int4, smollm2_dir):
    """The Q4_1 projection weights served by the int4 kernel are the file's weights (the
    GGUF's own dequantization of the same blocks) up to the bf16 rounding of the scales."""
    from verifier.model.weights import load_tensor
    lin = int4.net.model.layers[4].mlp.down_proj
    x = torch.eye(lin.in_features)
    served = lin.run(lin.own, x).float().t()        # [N, K]: the weights themselves (int4 or q4x16)
    file_w = load_tensor(smollm2_dir, "model.layers.4.mlp.down_proj.weight")
    err = (served - file_w).abs()
    assert err.max() <= 0.02 * file_w.abs().max()
    assert err.mean() < 1e-3


def test_default_quantization_is_int4_for_the_q4_gguf_and_none_for_hf(smollm2_dir, tiny_llama_dir):
    from verifier.quantized.quantize import auto_quantization
    assert auto_quantization(smollm2_dir, torch.device("cpu")) == "int4"
    assert auto_quantization(tiny_llama_dir, torch.device("cpu")) == "none"
    assert auto_quantization(smollm2_dir, torch.device("meta")) == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        TargetModel(str(tiny_llama_dir), quantization="int3")


def test_default_quantization_serves_a_mixed_file_on_its_own_blocks(tmp_path):
    """int4 only where the decoder is all int4 blocks: a Q4_K_M file of a model whose rows are
    not multiples of 256 stores most matrices as Q5_0 and Q6_K, which int4 would requantize;
    such files (and Q8_0 ones) take "gguf", each tensor on its own kernel."""
    import json
    from verifier.model.gguf_quant import INDEX_FILE
    from verifier.quantized.quantize import auto_quantization

    def auto(kinds, others):
        d = tmp_path / f"{'-'.join(kinds)}_{'-'.join(others)}"
        d.mkdir()
        tensors = [{"name": f"blk.{i}.ffn_down.weight", "kind": k} for i, k in enumerate(kinds)]
        (d / INDEX_FILE).write_text(json.dumps({"gguf": "", "tensors": tensors, "other_kinds": others}))
        return auto_quantization(d, torch.device("cpu"))
    assert auto(["Q4_K", "Q4_K"], []) == "int4" and auto(["Q4_1"], []) == "int4"
    if not cpu_ops.q4_isa():
        pytest.skip("the integer kernels are not built for this CPU")
    assert auto(["Q4_K", "Q8_0", "Q5_0", "Q6_K"], []) == "gguf" and auto(["Q8_0"], []) == "gguf"
    assert auto(["Q4_K"], ["Q5_K"]) == "gguf"


def test_quality_gate_on_a_short_text(int4, smollm2_dir):
    """Teacher-forced on 8 held-out replies (about 700 positions): top-1 agreement with the
    fp32 weights >= 99%, perplexity ratio <= 1.01."""
    from bench.quality import compare, heldout_conversations
    from conftest import shared_data
    heldout = shared_data("heldout/gsm8k_test.jsonl")      # a measure on the public set: skips without it
    reference = TargetModel(str(smollm2_dir), quantization="none")
    convs = heldout_conversations(reference.tokenizer, 8, path=heldout)
    q = compare(reference, int4, convs)
    print(f"{q.positions} positions: agreement {q.agreement:.4f}, perplexity ratio {q.ppl_ratio:.4f}")
    assert q.positions > 500
    assert q.agreement >= 0.99 and q.ppl_ratio <= 1.01


def test_hf_checkpoint_quantizes_at_load(tiny_llama_dir):
    """A dense HF checkpoint in int4 and int8: logits close to the fp32 model's."""
    ref = TargetModel(str(tiny_llama_dir), quantization="none")
    ids = list(range(10, 40))
    want = _logits(ref, ids)
    for mode, tol in (("int8", 0.05), ("int4", 0.3)):
        got = _logits(TargetModel(str(tiny_llama_dir), quantization=mode), ids)
        rel = (got - want).norm() / want.norm()
        print(f"{mode}: relative logit error {rel:.4f}")
        assert rel < tol


def _logits(target, ids):
    target.allocate_kv(4, BLOCK)
    return target.forward(ForwardBatch([SeqInput(ids, 0, [0, 1], logits_indices=list(range(len(ids))))])).logits


def test_sampled_from_marks_rows_without_logits_as_sampled_rows():
    """A chunk splits at its first sampled row: the first with logits, or `sampled_from` (a
    decode step whose grammar allows one token has no logits and is still a sampled row)."""
    from verifier.quantized.runner import split_at_first_sample
    assert split_at_first_sample(SeqInput([1], 5, [0], logits_indices=[])) == (SeqInput([1], 5, [0], logits_indices=[]),
                                                                            None)
    head, tail = split_at_first_sample(SeqInput([1, 2, 3], 5, [0], logits_indices=[], sampled_from=2))
    assert (head.token_ids, head.ctx_len, tail.token_ids, tail.ctx_len, tail.logits_indices) == ([1, 2], 5, [3], 7, [])
    assert split_at_first_sample(SeqInput([4], 5, [0], logits_indices=[], sampled_from=0))[0] is None
    with pytest.raises(ValueError, match="sampled_from"):
        SeqInput([1, 2, 3], 5, [0], logits_indices=[1], sampled_from=2)
