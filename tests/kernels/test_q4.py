"""Tercel's int4 kernel (csrc/q4_matmul.c, path "q4x16"): the vector code is bitwise its scalar
reference, a row's output does not depend on the other rows of the call, and the result is
x @ W.T on the weights as served, to within bf16 output rounding."""
from __future__ import annotations

import pytest
import torch

from quant_cases import activations, extreme_activations
from verifier.cpu import cpu_ops
from verifier.model.quant import Int4Weight, quantize_int4
from verifier.quantized.own_kernels.q4x16 import offered as q4_offered, pack_q4
from verifier.quantized.qlinear import QuantLinear, served_weights

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="q4x16 is built for AVX2 or AVX-512 VNNI")


def _weights(n: int, k: int, group: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = served_weights(quantize_int4(torch.randn(n, k, generator=g) * 0.05, group))
    return w, pack_q4(w)


@pytest.mark.parametrize("n, k, group", [(16, 32, 32), (40, 576, 32), (960, 576, 32), (72, 1536, 64),
                                         (48, 256, 128)])
def test_vector_path_is_bitwise_the_scalar_reference(n, k, group):
    w, packed = _weights(n, k, group)
    x = activations(17, k)                 # two full passes of 8 rows and one of 1
    assert torch.equal(cpu_ops.q4_matmul(packed, n, x), cpu_ops.q4_matmul(packed, n, x, reference=True))


def test_a_row_is_the_same_alone_and_among_others():
    """Alone, inside 2- to 17-row calls, at every place (before, across and after the 8-row
    passes): the same bits, the property T=0 speculation relies on."""
    w, packed = _weights(960, 576)
    x = activations(17, 576)
    full = cpu_ops.q4_matmul(packed, 960, x)
    for i in range(17):
        assert torch.equal(cpu_ops.q4_matmul(packed, 960, x[i:i + 1].contiguous())[0], full[i]), f"row {i}"
    for m in (2, 5, 8, 9, 10, 11, 15, 16):     # a tile's first 8 rows in one pass, the next in 4 + 3, 2, 1
        assert torch.equal(cpu_ops.q4_matmul(packed, 960, x[17 - m:].contiguous()), full[17 - m:]), f"{m} rows"


@pytest.mark.parametrize("group", [32, 64])
def test_result_is_the_served_weights_product(group):
    """Against x @ W.T in float64 on the dequantized weights: within bf16 output rounding
    (the 15-bit activations add about 1e-4 of each block's largest value). A layout the
    kernel reads differently from `pack_q4` (nibbles, channels or scales swapped) is far off."""
    n, k = 200, 576
    w, packed = _weights(n, k, group)
    x = activations(6, k)
    want = x.double() @ w.dequantize().double().t()
    got = cpu_ops.q4_matmul(packed, n, x).double()
    assert got.shape == (6, n)
    rel = (got - want).abs() / want.abs().clamp_min(1e-3 * want.abs().max())
    assert rel.median() < 2 ** -9 and rel.max() < 0.05
    assert ((got - want).norm() / want.norm()) < 3e-3


def test_zero_padded_channels_and_a_bad_k():
    w, packed = _weights(40, 64)
    assert packed.shape == (3, 2, 320)          # 40 channels -> 3 tiles of 16
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_ops.q4_matmul(packed, 40, torch.zeros(1, 48, dtype=torch.bfloat16))


def test_quant_linear_offers_q4x16_beside_torch_int4():
    w = quantize_int4(torch.randn(64, 128) * 0.1, 32)
    assert q4_offered(w)
    lin = QuantLinear(w, None, None)
    assert lin.own_paths() == ("int4", "q4x16") and lin.own == "int4"
    x = torch.randn(3, 128)
    lin.use_own("q4x16")
    assert torch.equal(lin.run_own(x.to(torch.bfloat16)), lin.run("q4x16", x))
    lin.drop_other_owns()
    assert lin.own_paths() == ("q4x16",) and not hasattr(lin, "packed")


def _avx2_q4_matmul():
    """q4_matmul from the same source built without AVX-512 (the AVX2 path)."""
    import ctypes
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    path = cpu_ops.compile_library(cpu_ops.INTEGER_MATMULS,   # one runner
                                   [*cpu_ops.FLAGS, "-mno-avx512f", "-lm"], ("CC", "cc", "gcc"), salt="avx2",
                                   headers=cpu_ops.HEADERS)
    lib = ctypes.CDLL(str(path))
    lib.q4_isa.restype = lib.q4_matmul.restype = ctypes.c_int64
    lib.q4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_void_p]
    assert lib.q4_isa() == 256

    def run(packed: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        assert lib.q4_matmul(packed.data_ptr(), n, x.shape[1], x.data_ptr(), x.shape[0], out.data_ptr()) == 0
        return out
    return run


def test_the_avx2_build_gives_the_same_bits():
    """The same source built without AVX-512 (the AVX2 path, as on machines without it)
    computes exactly what this machine's build does: the paths differ in instructions only."""
    run = _avx2_q4_matmul()
    w, packed = _weights(72, 1536, 64)
    for m in (10, 11, 17):                 # a tile's first 8 rows, then 2; 3; 4 + 4 and 1 (NIBBLE_TILE_FAST)
        x = activations(m, 1536)
        assert torch.equal(run(packed, 72, x), cpu_ops.q4_matmul(packed, 72, x)), f"{m} rows"


def test_the_avx2_sums_hold_at_the_extremes():
    """The AVX2 path adds eight vpmaddubsw results in 16 bits before widening: with every
    weight code 15 and activation digits at their extremes (hi = +-127, lo = -128) the sums
    come closest to overflowing, and must still equal the scalar reference's."""
    run = _avx2_q4_matmul()
    n, k = 32, 64
    q = torch.full((n, k), 15, dtype=torch.uint8)
    q[16:] = 0                                       # and the other end of the codes
    scale = torch.full((n, k // 32), 0.01)
    w = served_weights(Int4Weight(q, scale, torch.zeros_like(scale)))
    packed, x = pack_q4(w), extreme_activations(k)
    assert torch.equal(run(packed, n, x), cpu_ops.q4_matmul(packed, n, x, reference=True))


def test_the_isa_cap_runs_this_machine_as_an_avx2_one():
    """TERCEL_CPU_ISA=avx2 (how AVX2 paths are measured on an AVX-512 machine) builds the
    kernels for Haswell and holds torch to AVX2, before any of torch's kernels ran."""
    import os
    import subprocess
    import sys
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    code = ("import torch; from verifier.cpu import cpu_ops; from verifier.cpu.machine import machine_summary; "
            "print(cpu_ops.q4_isa(), torch.backends.cpu.get_cpu_capability(), machine_summary())")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TERCEL_CPU_ISA": "avx2"},
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=2)
    assert out[:2] == ["256", "AVX2"]
    assert "avx512" not in out[2] and "capped at AVX2" in out[2]
    bad = subprocess.run([sys.executable, "-c", "import verifier"], env={**env, "TERCEL_CPU_ISA": "sse9"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "TERCEL_CPU_ISA='sse9'" in bad.stderr
