"""GGUF files that mix block formats, as llama.cpp's K-quant files do (Q4_K_M: Q4_K beside Q6_K, Q5_0
and Q8_0), served with `quantization="gguf"`: each tensor on the kernel for its own blocks (int4 for
Q4_x, q8x16 for Q5_0 / Q6_K / Q8_0), the weights as stored, rows bitwise independent of their batch,
and T=0 speculation equal to plain decoding. The Q6_K blocks are written by the format's
definition (tests/quant_cases.py: gguf-py has no Q6_K quantizer) and checked here against gguf-py's
dequantizer."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from model_cases import BLOCK, converted, logits, write_gguf
from quant_cases import assert_loops_agree, q4_k_bytes, q6_k_bytes
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from verifier.batch import ForwardBatch, SeqInput
from verifier.cpu import cpu_ops
from verifier.target import TargetModel

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="the integer kernels are built for AVX2 or AVX-512 VNNI")
# Q4_K_M's choices, per GGUF tensor and layer: layer 0 as SmolLM2's (rows of 576 are not multiples
# of 256, so Q5_0 and Q8_0 stand in), layer 1 as a downloaded model's (Q4_K beside Q6_K), with a
# Q4_1 up projection beside a Q4_K gate (two int4 layouts in one fused projection).
KINDS = ({"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q4_1", "ffn_down": "Q6_K"},
         {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_1", "ffn_down": "Q4_K"})


def test_q5_0_q4_k_and_q6_k_blocks_read_as_gguf_py_dequantizes_them():
    import gguf
    from gguf.quants import dequantize, quantize

    from verifier.model.gguf_blocks import read_block_tensor
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    for kind, data in (("Q5_0", quantize(w, gguf.GGMLQuantizationType.Q5_0)), ("Q6_K", q6_k_bytes(w)),
                       ("Q4_K", q4_k_bytes(w))):
        want = dequantize(data, getattr(gguf.GGMLQuantizationType, kind))
        assert np.abs(want - w).max() < 0.1 * np.abs(w).max(), kind     # quant_cases' encoders write the formats
        assert np.array_equal(read_block_tensor(kind, data, 8, 512).dequantize().numpy(), want), kind


def _blocks(name: str, arr: np.ndarray):
    """A decoder matrix in its KINDS format (Q4_K and Q6_K by quant_cases' encoders, the others by
    gguf-py), else None."""
    import gguf
    from gguf.quants import quantize
    parts = name.split(".")
    kind = KINDS[int(parts[1])].get(parts[2]) if name.startswith("blk.") else None
    if kind is None:
        return None
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    encoders = {"Q4_K": q4_k_bytes, "Q6_K": q6_k_bytes}
    return (encoders[kind](arr) if kind in encoders else quantize(arr, qtype)), qtype


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """The GGUF converted as the loader converts one (its token list is no tokenizer: ids only)."""
    from safetensors.torch import load_file
    root = tmp_path_factory.mktemp("kquants")
    hf = make_tiny_model(root / "hf", None, hidden_size=256, intermediate_size=256)
    path = root / "tiny-mixed.gguf"
    fields = {"block_count": 2, "context_length": 1024, "embedding_length": 256, "feed_forward_length": 256,
              "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
              "rope.freq_base": 10000.0}
    reader = write_gguf(path, "llama", load_file(str(hf / "model.safetensors")), fields, blocks=_blocks)
    return converted(reader, path, root / "converted")


def test_each_tensor_runs_on_the_kernel_for_its_own_blocks(mixed_gguf):
    target = TargetModel(str(mixed_gguf), quantization="auto", load_tokenizer_files=False)
    assert target.quantization == "gguf"
    layer = target.net.model.layers[0]
    qkv, down, gate_up = layer.self_attn.qkv_proj, layer.mlp.down_proj, layer.mlp.gate_up_proj
    assert qkv.own == "mixed"                           # Q5_0 q and k beside a Q8_0 v: each its own bits
    assert qkv.loop_fields().s.tolist() == [[384, 5, 32], [128, 8, 32]]
    assert (down.own, down.bits) == ("q8x16", 6)        # Q6_K
    assert layer.self_attn.o_proj.bits == 5             # Q5_0
    assert gate_up.own in ("int4", "q4x16")             # Q4_1 on the int4 kernels
    layer = target.net.model.layers[1]                  # a downloaded Q4_K_M's choices
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert qkv.loop_fields().s.tolist() == [[384, 4, 256], [128, 6, 256]]      # Q4_K q and k, a Q6_K v
    assert gate_up.loop_fields().s.tolist() == [[256, 4, 256], [256, 4, 0]]   # Q4_K gate, Q4_1 up
    assert (layer.self_attn.o_proj.own, layer.mlp.down_proj.own) == ("q4k", "q4k")
    # the served weights are the file's: x = I gives them back, up to the bf16 rounding of the scales
    dense = TargetModel(str(mixed_gguf), quantization="none", load_tokenizer_files=False)
    file_w = dense.net.model.layers[0].mlp.down_proj.weight
    served = down.run(down.own, torch.eye(down.in_features)).float().t()
    assert (served - file_w).abs().max() <= 0.01 * file_w.abs().max()


def test_logits_stay_close_to_the_files_own_weights_and_rows_do_not_depend_on_neighbours(mixed_gguf):
    """The head's candidates (RescoredHead: an int4 scan, the best rescored on the file's blocks)
    get the file's logits within the bf16 activations' error."""
    ids = list(range(10, 40))
    want = logits(TargetModel(str(mixed_gguf), quantization="none", load_tokenizer_files=False), ids)
    target = TargetModel(str(mixed_gguf), quantization="gguf", load_tokenizer_files=False)
    got = logits(target, ids)
    top = want.topk(4, dim=-1).indices
    assert (got.gather(1, top) - want.gather(1, top)).norm() / want.gather(1, top).norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    target.allocate_kv(8, BLOCK)
    target.forward(ForwardBatch([SeqInput(ids, 0, [0, 1], logits_indices=[])]))
    target.forward(ForwardBatch([SeqInput(ids[:9], 0, [2, 3], logits_indices=[])]))
    alone = target.forward(ForwardBatch([SeqInput([7], len(ids), [0, 1])])).logits[0]
    batched = target.forward(ForwardBatch([SeqInput([9, 4, 2], 9, [2, 3]), SeqInput([7], len(ids), [0, 1])]))
    assert torch.equal(batched.logits[-1], alone)


def test_greedy_speculation_gives_plain_decoding_tokens(mixed_gguf):
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] * 2 for n in (5, 9, 13)]       # repeats to draft from
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=64, quantization="gguf")
    plain = [o.token_ids for o in LLM(str(mixed_gguf), **kw).generate(prompts, greedy)]
    llm = LLM(str(mixed_gguf), drafter="suffix", adaptive=AdaptiveConfig(enabled=False), **kw)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.verify_steps for o in outs) > 0


def test_one_fused_projection_in_two_formats_takes_the_finer_one():
    from verifier.model.quant import Int4Weight, Int8Weight, quantize_int4, quantize_int8
    from verifier.quantized.quantize import _one_form
    w = torch.randn(32, 64) * 0.1
    q4, q8_32, q8_16 = quantize_int4(w, 32), quantize_int8(w, 32), quantize_int8(w, 16)
    parts = _one_form([q4, q8_32, q8_16])
    assert all(isinstance(p, Int8Weight) and p.group == 16 for p in parts)
    assert torch.equal(parts[1].dequantize(), q8_32.dequantize())       # regrouping is exact
    assert (parts[0].dequantize() - q4.dequantize()).abs().max() <= q4.dequantize().abs().max() / 200
    assert _one_form([q4, q4]) == [q4, q4] and isinstance(_one_form([q4])[0], Int4Weight)


def test_the_native_loop_is_bitwise_the_python_loop(mixed_gguf):
    """The q8x16 kernel called from the C++ loop (kind 32) gives what the Python loop's call gives:
    a decode row and a 20-token prompt in one forward, the logits and the KV written."""
    target = TargetModel(str(mixed_gguf), quantization="gguf", load_tokenizer_files=False)
    target.allocate_kv(16, BLOCK)
    target.forward(ForwardBatch([SeqInput(list(range(100, 140)), 0, [0, 1, 2, 3])]))
    native, results = target.runner.native, []
    assert native is not None, "the native loop did not build on this machine"
    for loop in (native, None):
        target.runner.native = loop
        out = target.forward(ForwardBatch([SeqInput([7], 40, [0, 1, 2, 3]), SeqInput(list(range(200, 220)), 0, [8, 9])],
                                          capture_layers=(1,)))
        results.append((out.logits.clone(), {k: v.clone() for k, v in out.hidden.items()},
                        target.kv.k.clone(), target.kv.v.clone()))
    target.runner.native = native
    assert_loops_agree(results)


def test_one_layer_of_each_kind_runs_inside_and_the_whole_model_after(mixed_gguf):
    """The thread governor's check runs one layer of each kind: both of this file's layers (their
    blocks differ), so inside, the same logits as the whole model; its dense twin quantized to
    int4 has two layers of one kind, so inside, a one-layer model; after, the whole model again."""
    ids = list(range(10, 30))
    for model, quantization, kept in ((mixed_gguf, "gguf", 2), (mixed_gguf.parent / "hf", "int4", 1)):
        target = TargetModel(str(model), quantization=quantization, load_tokenizer_files=False)
        whole = logits(target, ids)
        with target.one_layer_per_kind():
            assert len(target.runner.layers) == kept
            inside = logits(target, ids)
        assert len(target.runner.layers) == 2 and torch.equal(logits(target, ids), whole)
        assert torch.equal(inside, whole) == (kept == 2)


def test_the_thread_check_sees_a_kernel_that_only_a_later_layer_kind_runs(mixed_gguf, monkeypatch, tmp_path):
    """A kernel whose bits follow the thread count in layer 1's qkv alone (a kind layer 0 lacks)
    turns the governor off: a check over the first layer only would miss it."""
    from spec import curve_cache
    from verifier.quantized.qlinear import QuantLinear
    marked = TargetModel(str(mixed_gguf), quantization="gguf", load_tokenizer_files=False).runner.layers[1].qkv.layout()
    run_own, caches = QuantLinear.run_own, iter([tmp_path / "a", tmp_path / "b"])
    monkeypatch.setattr(curve_cache, "cache_root", lambda: next(caches))

    def thread_dependent(self, x):
        y = run_own(self, x)
        return y + 1 if torch.get_num_threads() == 1 and self.layout() == marked else y
    monkeypatch.setattr(QuantLinear, "run_own", thread_dependent)
    kw = dict(max_model_len=64, num_kv_blocks=8, num_threads=2, quantization="gguf")
    assert not LLM(str(mixed_gguf), **kw).engine.threads.active
    monkeypatch.setattr(QuantLinear, "run_own", run_own)
    assert LLM(str(mixed_gguf), **kw).engine.threads.active
