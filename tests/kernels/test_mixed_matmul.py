"""A fused projection whose parts a file stores in different formats (csrc/mixed_matmul.c, path
"mixed"): each part keeps its own layout and its kernel's bits, in one call; a row's output does
not depend on the other rows; and the loader keeps parts apart only where their layouts differ."""
from __future__ import annotations

import pytest
import torch

from quant_cases import activations, int8_weights
from verifier.cpu import cpu_ops
from verifier.model.quant import Int4Weight, Int8Weight, StackedWeight, concat_rows, quantize_int4
from verifier.quantized.own_kernels import mixed, q4x16, q8x16
from verifier.quantized.qlinear import QuantLinear, served_weights
from verifier.quantized.quantize import _fused

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="the mixed kernel is built for AVX2 or AVX-512 VNNI")


def _int4_weights(n: int, k: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    return served_weights(quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32))


def _stack(k: int) -> StackedWeight:
    """int4 (q4x16), 5 bits in 32s, 6 bits in 16s, 8 bits in 32s: every layout, with part
    rows that end inside a tile (40 = 2.5 tiles)."""
    return StackedWeight((_int4_weights(48, k), int8_weights(40, k, 5, 32, seed=1),
                          int8_weights(24, k, 6, 16, seed=2), int8_weights(40, k, 8, 32, seed=3)))


def _own(part, x: torch.Tensor) -> torch.Tensor:
    """The part through its own kernel alone."""
    if isinstance(part, Int4Weight):
        return cpu_ops.q4_matmul(q4x16.pack_q4(part), part.shape[0], x)
    bits = q8x16.q8_bits(part)
    return cpu_ops.q8_matmul(q8x16.pack_q8(part, bits), bits, part.group, part.shape[0], x)


@pytest.mark.parametrize("k", [64, 576])
def test_each_part_gets_its_own_kernels_bits(k):
    w = _stack(k)
    packed, table = mixed.pack_parts(w)
    assert table.tolist() == [[48, 4, 0], [40, 5, 32], [24, 6, 16], [40, 8, 32]]
    x = activations(17, k)             # two full passes of 8 rows and one of 1
    got = cpu_ops.mixed_matmul(packed, table, 152, x)
    assert torch.equal(got, cpu_ops.mixed_matmul(packed, table, 152, x, reference=True))
    assert torch.equal(got, torch.cat([_own(p, x) for p in w.parts], 1))


def test_a_row_is_the_same_alone_and_among_others():
    w = _stack(576)
    packed, table = mixed.pack_parts(w)
    x = activations(17, 576)
    full = cpu_ops.mixed_matmul(packed, table, 152, x)
    for i in range(17):
        assert torch.equal(cpu_ops.mixed_matmul(packed, table, 152, x[i:i + 1].contiguous())[0], full[i]), f"row {i}"


def test_bad_tables_are_refused():
    packed, table = mixed.pack_parts(_stack(64))
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows add up to 150"):
        cpu_ops.mixed_matmul(packed, table, 150, x)
    bad = table.clone()
    bad[1, 1] = 7
    with pytest.raises(ValueError, match="4, 5, 6 or 8"):
        cpu_ops.mixed_matmul(packed, bad, 152, x)


def test_the_loader_keeps_parts_apart_only_where_layouts_differ():
    q, k = int8_weights(64, 128, 5, 32, seed=1), int8_weights(32, 128, 5, 32, seed=2)
    v = int8_weights(32, 128, 8, 32, seed=3)
    # a Q4_K_M's Q5_0 q and k beside a Q8_0 v: two parts, q and k stacked as one
    fused = _fused([q, k, v])
    assert isinstance(fused, StackedWeight) and [p.shape[0] for p in fused.parts] == [96, 32]
    lin = QuantLinear(fused, None, None)
    assert lin.own_paths() == ("mixed",) and lin.kind == "mixed"
    x = activations(3, 128)
    assert torch.equal(lin.run_own(x), torch.cat([_own(concat_rows([q, k]), x), _own(v, x)], 1))
    # as served, the weight is the parts' weights in order
    assert torch.equal(served_weights(fused).dequantize(), torch.cat([p.dequantize() for p in (q, k, v)]))
    # one layout: one weight, as before
    same = _fused([q, k, int8_weights(32, 128, 5, 32, seed=4)])
    assert isinstance(same, Int8Weight) and same.shape == (128, 128)
    # int4 beside int8 (Q4_K beside Q6_K): the int4 parts stay int4, not int8
    mixed_forms = _fused([_int4_weights(64, 128), int8_weights(32, 128, 6, 16)])
    assert [type(p) for p in mixed_forms.parts] == [Int4Weight, Int8Weight]


def test_without_the_mixed_kernel_parts_share_the_finer_form(monkeypatch):
    monkeypatch.setattr(mixed, "offered", lambda w: False)
    q, v = int8_weights(64, 128, 5, 32, seed=1), int8_weights(32, 128, 8, 32, seed=3)
    fused = _fused([q, v])
    assert isinstance(fused, Int8Weight) and q8x16.q8_bits(fused) == 8
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), v.dequantize()]))
