"""Tercel's kernel for 5-, 6- and 8-bit weight blocks (csrc/q8_matmul.c, path "q8x16"): the vector
code is bitwise its scalar reference (this machine's build and the AVX2 one), a row's output does
not depend on the other rows of the call, and the result is x @ W.T on the weights as served."""
from __future__ import annotations

import pytest
import torch

from quant_cases import activations, avx2_q8_matmul, extreme_activations, int8_weights
from verifier.cpu import cpu_ops
from verifier.model.quant import Int8Weight, quantize_int8
from verifier.quantized.own_kernels.q8x16 import offered as q8_offered, pack_q8, q8_bits
from verifier.quantized.qlinear import QuantLinear, served_weights

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="q8x16 is built for AVX2 or AVX-512 VNNI")

FORMATS = [(5, 32), (6, 16), (8, 32), (5, 16), (6, 32), (8, 16)]     # Q5_0, Q6_K, Q8_0, then the other groupings


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("n,k", [(16, 32), (40, 576), (200, 1536)])
def test_vector_path_is_bitwise_the_scalar_reference(bits, group, n, k):
    w = int8_weights(n, k, bits, group)
    assert q8_bits(w) == bits
    packed, x = pack_q8(w), activations(17, k)        # two full passes of 8 rows and one of 1
    assert torch.equal(cpu_ops.q8_matmul(packed, bits, group, n, x), cpu_ops.q8_matmul(packed, bits, group, n, x, reference=True))


@pytest.mark.parametrize("bits,group", FORMATS)
def test_a_row_is_the_same_alone_and_among_others(bits, group):
    w = int8_weights(96, 576, bits, group)
    packed, x = pack_q8(w), activations(17, 576)
    full = cpu_ops.q8_matmul(packed, bits, group, 96, x)
    for i in range(17):
        assert torch.equal(cpu_ops.q8_matmul(packed, bits, group, 96, x[i:i + 1].contiguous())[0], full[i]), f"row {i}"
    for m in (2, 5, 8, 9, 16):
        assert torch.equal(cpu_ops.q8_matmul(packed, bits, group, 96, x[17 - m:].contiguous()), full[17 - m:]), f"{m} rows"


@pytest.mark.parametrize("bits,group", FORMATS)
def test_result_is_the_served_weights_product(bits, group):
    """Against x @ W.T in float64 on the dequantized weights: within bf16 output rounding. A
    layout the kernel reads differently from `pack_q8` (a plane, a half's scale or a channel
    swapped) is far off."""
    n, k = 200, 576
    w = int8_weights(n, k, bits, group)
    x = activations(6, k)
    want = x.double() @ w.dequantize().double().t()
    got = cpu_ops.q8_matmul(pack_q8(w), bits, group, n, x).double()
    assert got.shape == (6, n)
    rel = (got - want).abs() / want.abs().clamp_min(1e-3 * want.abs().max())
    assert rel.median() < 2 ** -9 and rel.max() < 0.05
    assert ((got - want).norm() / want.norm()) < 3e-3


def test_padded_channels_and_bad_arguments():
    w = int8_weights(40, 64, 6, 16)
    packed = pack_q8(w)
    assert packed.shape == (3, 2, 256 + 2 * 64 + 64)        # 40 channels -> 3 tiles of 16
    assert pack_q8(int8_weights(40, 64, 5, 32)).shape == (3, 2, 256 + 64 + 32)     # Q5_0's 22 bytes per 32
    assert pack_q8(int8_weights(40, 64, 8, 32)).shape == (3, 2, 512 + 32)          # Q8_0's 34 bytes per 32
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_ops.q8_matmul(packed, 6, 16, 40, torch.zeros(1, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="5, 6 or 8 bits"):
        cpu_ops.q8_matmul(packed, 7, 16, 40, torch.zeros(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="groups of 16, 32 or 256"):
        cpu_ops.q8_matmul(packed, 6, 64, 40, torch.zeros(1, 64, dtype=torch.bfloat16))


def test_quant_linear_serves_blocks_on_q8x16_and_channels_on_torch_int8():
    blocks = quantize_int8(torch.randn(64, 128) * 0.1, 32)
    assert q8_offered(blocks)
    lin = QuantLinear(blocks, None, None)
    assert lin.own_paths() == ("q8x16",) and lin.own == "q8x16" and lin.bits == 8
    x = torch.randn(3, 128)
    assert torch.equal(lin.run_own(x.to(torch.bfloat16)), lin.run("q8x16", x))
    channels = QuantLinear(quantize_int8(torch.randn(64, 128) * 0.1), None, None)
    assert channels.own_paths() == ("int8",)


@pytest.mark.parametrize("bits,group", FORMATS)
def test_the_avx2_build_gives_the_same_bits(bits, group):
    run = avx2_q8_matmul()
    w = int8_weights(72, 1536, bits, group)
    x = activations(11, 1536)
    assert torch.equal(run(pack_q8(w, masks=False), bits, group, 72, x), cpu_ops.q8_matmul(pack_q8(w), bits, group, 72, x))


@pytest.mark.parametrize("bits,group", FORMATS)
def test_the_avx2_sums_hold_at_the_extremes(bits, group):
    """The AVX2 path adds vpmaddubsw results in 16 bits before widening (pairs of them for 5 and 6
    bits, four of each nibble for 8): with every weight at the top or bottom of its range and the
    activation digits at their extremes (hi = +-127, lo = -128) the sums come closest to
    overflowing, and must still equal the scalar reference's."""
    run = avx2_q8_matmul()
    n, k = 32, 64
    q = torch.full((n, k), (1 << (bits - 1)) - 1, dtype=torch.int8)
    q[16:] = -(1 << (bits - 1))
    scale = torch.full((n, k // group), 0.01)
    w = served_weights(Int8Weight(q, scale))
    x = extreme_activations(k)
    assert torch.equal(run(pack_q8(w, masks=False), bits, group, n, x),
                       cpu_ops.q8_matmul(pack_q8(w), bits, group, n, x, reference=True))
