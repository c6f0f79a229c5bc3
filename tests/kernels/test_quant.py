"""Quantized weights and the CPU matmul paths: GGUF blocks read as they are, kernels agree
with the dequantized weights, decode rows are batch-invariant, the path choice is measured
and cached."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verifier.cpu import cpu_ops
from verifier.model.gguf_blocks import read_block_tensor
from verifier.model.quant import (Int4KWeight, Int4Weight, Int8Weight, concat_rows, int4_group, int4_from_affine,
                                  per_channel, quantize_int4, quantize_int8)
from verifier.quantized.matmul_paths import KernelPlan, KernelTimings, engine_rows, load_or_time, time_paths
from verifier.quantized.qlinear import QuantEmbedding, QuantLinear, served_weights


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_bit_exactly(kind):
    """Blocks written by gguf-py's own quantizer decode to exactly gguf-py's dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    blocks = quantize(w, qtype)
    ours = read_block_tensor(kind, blocks, 48, 96)
    assert isinstance(ours, Int8Weight if kind == "Q8_0" else Int4Weight)
    assert torch.equal(ours.dequantize(), torch.from_numpy(dequantize(blocks, qtype).reshape(48, 96)))


def test_q4_k_blocks_decode_to_ggufs_weights():
    """Q4_K super-blocks by the format's definition (gguf-py cannot write them: random
    scales, mins and nibbles under random fp16 d and dmin) decode to gguf-py's weights, held with
    their own scales (the q4k kernel's form) and, for the int4 kernels, as int4 groups of 32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    rng = np.random.default_rng(0)
    rows, cols = 8, 512
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    halves = (rng.random((rows, cols // 256, 2)) * 0.01).astype(np.float16)
    blocks[..., 0:4] = halves.view(np.uint8)                      # d, dmin
    ours = read_block_tensor("Q4_K", blocks, rows, cols)
    assert isinstance(ours, Int4KWeight) and ours.group == 32
    want = torch.from_numpy(dequantize(blocks.reshape(rows, -1), GGMLQuantizationType.Q4_K).reshape(rows, cols))
    assert torch.equal(ours.dequantize(), want)
    int4 = ours.as_grouped()
    assert isinstance(int4, Int4Weight) and int4.group == 32 and torch.equal(int4.dequantize(), want)


def test_affine_blocks_keep_their_weights():
    """w = d q + m becomes (q - 8) d + (m + 8 d): the same weights."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=g)
    d, m = torch.rand(16, 2, generator=g), torch.randn(16, 2, generator=g)
    want = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    torch.testing.assert_close(int4_from_affine(q, d, m).dequantize(), want, rtol=0, atol=1e-6)


def test_quantizers_round_to_the_nearest_level():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    w4 = quantize_int4(w, 32)
    step = w4.scale.repeat_interleave(32, 1)
    assert ((w4.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    w8 = quantize_int8(w)
    assert w8.group == 128 and ((w8.dequantize() - w).abs() <= w8.scale / 2 + 1e-6).all()
    blockwise = quantize_int8(w, 32)
    assert per_channel(blockwise).group == 128
    assert int4_group(576) == 32 and int4_group(1536) == 32
    with pytest.raises(ValueError, match="divisible by 32"):
        int4_group(100)


def _linear(kind: str, n: int = 64, k: int = 128, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    q = quantize_int4(w, 32) if kind == "int4" else quantize_int8(w)
    lin = QuantLinear(q, None, KernelPlan(kind))
    return lin, served_weights(per_channel(q) if kind == "int8" else q).dequantize()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_every_own_kernel_computes_the_served_weights(kind):
    """Each kernel the weight offers agrees with x @ W.T on the weights as served."""
    lin, w = _linear(kind, n=72)            # 72 output channels: the int4 kernel pads to 80
    x = torch.randn(5, 128)
    want = x.to(torch.bfloat16).float() @ w.t()
    for path in lin.own_paths():
        got = lin.run(path, x).float()
        assert got.shape == (5, 72)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["int4", "q4x16", "int8"])
def test_own_kernel_rows_are_batch_invariant(kind):
    """A row alone and inside 2-, 5-, 8- and 16-row calls: bitwise the same on the weight's own
    kernels (the property T=0 speculation relies on)."""
    lin, _ = _linear("int8" if kind == "int8" else "int4", n=576, k=576)
    if kind not in lin.own_paths():
        pytest.skip(f"{kind} is not offered on this machine")
    x = torch.randn(16, 576)
    alone = lin.run(kind, x[3:4])
    for m in (2, 5, 8, 16):
        rows = x[:m] if m > 3 else torch.cat([x[:m - 1], x[3:4]])
        assert torch.equal(lin.run(kind, rows)[min(3, m - 1)], alone[0]), f"{m} rows"


def test_a_linear_holds_its_packed_kernels_only():
    """No dense copy: a QuantLinear's bytes are its kernels' packed layouts, about half a byte a
    weight for int4 (a dense bf16 copy alone would be 2); told the plan's kernel, it packs that
    one only."""
    w = quantize_int4(torch.randn(256, 512), 32)
    every = QuantLinear(w, None, None)
    one = QuantLinear(w, None, None, own="int4")
    assert one.own_paths() == ("int4",) and one.nbytes() < 0.7 * w.q.numel()
    assert every.nbytes() == sum(QuantLinear(w, None, None, own=p).nbytes() for p in every.own_paths())
    every.use_own("int4")
    every.drop_other_owns()
    assert every.nbytes() == one.nbytes()
    assert QuantLinear(w, None, None, own="q8x16").own_paths() == (every.own,)   # not offered: its first


def test_fused_rows_and_embedding():
    a, b = quantize_int4(torch.randn(16, 64), 32), quantize_int4(torch.randn(32, 64), 32)
    both = concat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="one quantization kind"):
        concat_rows([a, quantize_int8(torch.randn(8, 64))])
    ids = torch.tensor([5, 0, 99, 5])
    for table in (quantize_int8(torch.randn(100, 64), 32), quantize_int4(torch.randn(100, 64), 32)):
        emb = QuantEmbedding(table)
        assert torch.equal(emb(ids), table.dequantize()[ids])
    assert emb.q.shape == (100, 32)                 # int4: two a byte


def test_timings_are_cached(tmp_path):
    """A second load reads the cache instead of measuring; another key measures again."""
    fake = KernelTimings((1, 8), {"int4": {1: 1.0, 8: 4.0}}, {"int4": True})
    calls = []
    measure = lambda: calls.append(1) or fake  # noqa: E731
    first = load_or_time((1, 8, 64), {"model": "m"}, tmp_path, measure)
    again = load_or_time((1, 8, 64), {"model": "m"}, tmp_path, measure)
    assert first == again == fake and len(calls) == 1
    (cached,) = tmp_path.glob("*.json")
    assert json.loads(cached.read_text())["key"]["model"] == "m"
    load_or_time((1, 8, 64), {"model": "other"}, tmp_path, measure)
    assert len(calls) == 2


def test_the_plan_takes_the_own_kernel_with_the_lowest_total_up_to_8_rows():
    """The row-invariant own kernel cheapest over 1 to 8 rows, though slower at one count; a
    kernel that failed the probe, or was not timed at every count, is not chosen."""
    rows = (1, 2, 4, 8, 64)
    ms = {"int4": {1: 4.0, 2: 5.0, 4: 7.0, 8: 14.0, 64: 40.0}, "q4x16": {1: 4.5, 2: 4.6, 4: 5.0, 8: 8.0, 64: 30.0}}
    t = KernelTimings(rows, ms, {"int4": True, "q4x16": True})
    assert t.plan(("int4", "q4x16")) == KernelPlan("q4x16")
    probe_failed = KernelTimings(rows, ms, {"int4": True, "q4x16": False})
    assert probe_failed.plan(("int4", "q4x16")) == KernelPlan("int4")
    untimed = KernelTimings(rows, {**ms, "q4x16": {**ms["q4x16"], 8: None}}, {"int4": True, "q4x16": True})
    assert untimed.plan(("int4", "q4x16")).own == "int4"


def test_timing_and_invariance_probe_on_real_kernels():
    """The int4 kernels are timed at every count and row-invariant from one row."""
    lin, _ = _linear("int4")
    measured = time_paths([lin], (1, 2), repeats=1)
    owns = {"int4", "q4x16"} if cpu_ops.q4_isa() else {"int4"}
    assert set(measured.ms) == owns and all(measured.ms[p][m] > 0 for p in owns for m in (1, 2))
    assert all(measured.invariant[p] for p in owns)


def test_only_the_choices_are_probed_fastest_first_up_to_one_that_passes(monkeypatch):
    """With the plan's choices given, the fastest is probed first and, passing, kept unprobed
    others; failing, the next is probed and kept. The plan is the one probing them all gives."""
    from verifier.quantized import matmul_paths
    lin, _ = _linear("int4")
    owns = lin.own_paths()
    if len(owns) < 2:
        pytest.skip("one int4 kernel on this machine: no choice to probe")
    fast, slow = owns[::-1]
    monkeypatch.setattr(matmul_paths, "_time_once", lambda lins, path, m, warm_up: m * (1.0 if path == fast else 2.0))
    for fast_passes in (True, False):
        probed = []
        monkeypatch.setattr(matmul_paths, "row_invariant",
                            lambda lins, path: probed.append(path) or path != fast or fast_passes)
        t = time_paths([lin], (1, 2), choices=owns)
        assert probed == ([fast] if fast_passes else [fast, slow])
        everything = time_paths([lin], (1, 2))
        assert t.plan(owns) == everything.plan(owns) == KernelPlan(fast if fast_passes else slow)


def test_a_burst_of_host_noise_in_one_round_does_not_change_the_plan(monkeypatch):
    """A stall during one run (here: the faster kernel's largest count, first round, 100 times
    its time) is one of that count's rounds, of which the fastest is kept: the plan stays the
    faster kernel. Timed in one go, the count's every sample would have held it."""
    from verifier.quantized import matmul_paths
    lin, _ = _linear("int4")
    owns = lin.own_paths()
    if len(owns) < 2:
        pytest.skip("one int4 kernel on this machine: no choice to make")
    fast, slow = owns
    runs = []

    def timed(lins, path, m, warm_up):
        runs.append((path, m))
        burst = path == fast and m == 3 and runs.count((path, m)) == 1
        return m * (1.0 if path == fast else 2.0) * (100.0 if burst else 1.0)
    monkeypatch.setattr(matmul_paths, "_time_once", timed)
    monkeypatch.setattr(matmul_paths, "row_invariant", lambda lins, path: True)
    t = time_paths([lin], (1, 2, 3), repeats=3, choices=owns)
    assert t.ms[fast][3] == 3.0 and t.plan(owns) == KernelPlan(fast)
    runs.clear()
    assert time_paths([lin], (1, 2, 3), repeats=1, choices=owns).plan(owns) == KernelPlan(slow)   # the control


def test_the_probe_fails_a_kernel_whose_rows_change_with_the_calls_size(monkeypatch):
    """A kernel that sums in another order for small calls (here: one bf16 step on rows of calls
    under 8 rows) fails the row-invariance probe; the same kernel untouched passes."""
    from verifier.quantized.matmul_paths import row_invariant
    lin, _ = _linear("int4")
    assert row_invariant([lin], "int4")
    run = lin.run

    def small_calls_differ(path, x):
        y = run(path, x)
        return y if x.shape[0] >= 8 else y.nextafter(torch.full_like(y, float("inf")))
    monkeypatch.setattr(lin, "run", small_calls_differ)
    assert not row_invariant([lin], "int4")


def test_the_probe_compares_as_many_outputs_on_fewer_inputs_for_wide_weights(monkeypatch):
    """Four inputs for a tiny weight, one where one input compares PROBE_OUTPUTS outputs; never
    more than asked."""
    from verifier.quantized.matmul_paths import PROBE_OUTPUTS, probe_seeds, row_invariant
    counts = (1, 3, 8, 33)
    assert probe_seeds(64, counts, 4) == 4 and probe_seeds(2048, counts, 4) == 1 and probe_seeds(64, counts, 2) == 2
    assert 2048 * sum(counts) >= PROBE_OUTPUTS > 1024 * sum(counts) and probe_seeds(1024, counts, 4) == 2
    for n, seeds in ((64, 4), (2048, 1)):
        lin, _ = _linear("int4", n=n, k=64)
        calls, run = [], lin.run
        monkeypatch.setattr(lin, "run", lambda path, x: calls.append(x.shape[0]) or run(path, x))
        assert row_invariant([lin], "int4", counts)
        assert calls.count(64) == seeds


def test_cliff_is_the_last_count_before_a_jump():
    t = KernelTimings((1, 2, 3, 4, 5, 6), {"int4": {1: 5.8, 2: 6.9, 3: 8.4, 4: 9.6, 5: 15.3, 6: 15.2}}, {"int4": True})
    assert t.rows_before_cliff("int4") == 4
    noisy = KernelTimings((1, 2, 3, 4), {"q4x16": {1: 3.42, 2: 5.10, 3: 3.81, 4: 5.18}}, {"q4x16": True})
    assert noisy.rows_before_cliff("q4x16") is None          # 2 rows timed high once: no cliff


def test_engine_rows_cover_trees_batches_and_the_chunk():
    rows = engine_rows(384)
    assert rows[:8] == (1, 2, 3, 4, 5, 6, 7, 8)
    assert {16, 32, 256, 384} <= set(rows) and max(rows) == 384


def test_kernel_timings_are_keyed_by_shapes_not_by_values():
    """Weights of the same shapes and kinds share one cached measurement (a model's copies, or
    the tests' random models, are timed once per machine); another shape or kind is timed anew."""
    from verifier.quantized.quantize import shapes_key
    same = [_linear("int4", seed=0)[0], _linear("int8", seed=0)[0]]
    other_values = [_linear("int4", seed=1)[0], _linear("int8", seed=1)[0]]
    assert shapes_key(same) == shapes_key(other_values)
    assert shapes_key(same) != shapes_key([_linear("int4", n=128)[0], same[1]])
    assert shapes_key(same) != shapes_key([same[0], _linear("int4", seed=0)[0]])
