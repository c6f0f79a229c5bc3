"""Tercel's kernel for GGUF's Q4_K blocks as stored (csrc/q4k_matmul.c, path "q4k"): the vector
code is bitwise its scalar reference on both instruction sets, a row's output does not depend on
the other rows, the result is x @ W.T on the file's weights, and the loader serves Q4_K on it
(beside other formats in one fused projection, and in the int4 form where it is not built)."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from quant_cases import activations, assert_near_product, extreme_activations, int8_weights, q4_k_weights
from verifier.cpu import cpu_ops
from verifier.model.quant import Int4KWeight, Int4Weight, StackedWeight
from verifier.quantized import own_kernels
from verifier.quantized.own_kernels import mixed, q4k, q4x16, q8x16
from verifier.quantized.qlinear import QuantLinear
from verifier.quantized.quantize import _fused, _one_form

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="q4k is built for AVX2 or AVX-512 VNNI")


def _run(w: Int4KWeight, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    packed, parts, n = q4k.pack(w).args
    return cpu_ops.mixed_matmul(packed, parts, n, x, reference=reference)


@pytest.mark.parametrize("n, k", [(16, 256), (40, 512), (200, 1536)])
def test_vector_path_is_bitwise_the_scalar_reference(n, k):
    w, x = q4_k_weights(n, k), activations(17, k)             # two full passes of 8 rows and one of 1
    assert torch.equal(_run(w, x), _run(w, x, reference=True))


def test_a_row_is_the_same_alone_and_among_others():
    w, x = q4_k_weights(96, 768), activations(17, 768)
    full = _run(w, x)
    for i in range(17):
        assert torch.equal(_run(w, x[i:i + 1].contiguous())[0], full[i]), f"row {i}"
    for m in (2, 3, 5, 9, 10, 11, 15):         # a tile's first 8 rows in one pass, the next in 4 + 3, 2, 1
        assert torch.equal(_run(w, x[17 - m:].contiguous()), full[17 - m:]), f"{m} rows"


def test_result_is_the_files_weights_product():
    """Against x @ W.T in float64 on the file's weights (d * sc exact, nothing rounded to bf16):
    within the 15-bit activations' error. A layout read differently from `pack_q4k` (scales of
    another sub-block or channel, d and dmin swapped, the mins' sign) is far off."""
    w, x = q4_k_weights(200, 512, seed=3), activations(6, 512)
    assert_near_product(_run(w, x), x.double() @ w.dequantize().double().t())


def test_the_int4_form_holds_the_same_weights():
    w = q4_k_weights(32, 512)
    assert torch.equal(w.as_grouped().dequantize(), w.dequantize())


def _avx2_library() -> ctypes.CDLL:
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    path = cpu_ops.compile_library(cpu_ops.INTEGER_MATMULS, [*cpu_ops.FLAGS, "-mno-avx512f", "-lm"],
                                   ("CC", "cc", "gcc"), salt="avx2", headers=cpu_ops.HEADERS)
    lib = ctypes.CDLL(str(path))
    lib.q4_isa.restype = lib.mixed_matmul.restype = ctypes.c_int64
    lib.mixed_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p]
    assert lib.q4_isa() == 256
    return lib


def _run_avx2(lib: ctypes.CDLL, w: Int4KWeight, x: torch.Tensor) -> torch.Tensor:
    packed, parts, n = q4k.pack(w).args
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    assert lib.mixed_matmul(packed.data_ptr(), parts.data_ptr(), 1, n, x.shape[1], x.data_ptr(), x.shape[0],
                            out.data_ptr()) == 0
    return out


def test_the_avx2_build_gives_the_same_bits():
    lib = _avx2_library()
    w = q4_k_weights(72, 1536, seed=5)
    for m in (10, 11, 17):                 # a tile's first 8 rows, then 2; 3; 4 + 4 and 1 (NIBBLE_TILE_FAST)
        x = activations(m, 1536)
        assert torch.equal(_run_avx2(lib, w, x), _run(w, x)), f"{m} rows"
    # the integer sums' worst cases: every code 15 (and 0), activation digits at their extremes
    w = q4_k_weights(32, 256, q_max=1, sc_max=1)
    w.q[:16] = 15
    x = extreme_activations(256)
    assert torch.equal(_run_avx2(lib, w, x), _run(w, x, reference=True))


def test_a_linear_serves_q4_k_on_its_own_kernel():
    w = q4_k_weights(64, 512)
    lin = QuantLinear(w, None, None)
    assert lin.own_paths() == ("q4k",) and lin.kind == "int4"
    x = activations(3, 512)
    assert torch.equal(lin.run_own(x), _run(w, x))


def test_where_q4k_is_not_built_q4_k_takes_the_int4_form(monkeypatch):
    monkeypatch.setitem(own_kernels.KERNELS, "q4k", dataclasses.replace(q4k.KERNEL, offered=lambda w: False))
    monkeypatch.setattr(mixed, "offered", lambda w: False)
    w = q4_k_weights(64, 512)
    served, owns = own_kernels.kernels_for(w)
    assert isinstance(served, Int4Weight) and "q4k" not in [k.name for k in owns]
    assert torch.equal(served.dequantize(), w.dequantize())
    # in a fused projection beside Q6_K: the int4 form, then (no mixed kernel) the finer int8 one
    assert all(not isinstance(p, Int4KWeight) for p in _one_form([w, int8_weights(32, 512, 6, 16)]))


def test_q4_k_beside_q6_k_in_one_fused_projection():
    """A downloaded Q4_K_M's qkv (Q4_K q and k, a Q6_K v): each part on its own kernel's bits."""
    q, k, v = q4_k_weights(64, 512, seed=1), q4_k_weights(32, 512, seed=2), int8_weights(32, 512, 6, 16, seed=3)
    fused = _fused([q, k, v])
    assert isinstance(fused, StackedWeight) and [type(p) for p in fused.parts] == [Int4KWeight, type(v)]
    packed, table = mixed.pack_parts(fused)
    assert table.tolist() == [[96, 4, 256], [32, 6, 16]]
    x = activations(9, 512)
    got = cpu_ops.mixed_matmul(packed, table, 128, x)
    assert torch.equal(got, cpu_ops.mixed_matmul(packed, table, 128, x, reference=True))
    v_alone = cpu_ops.q8_matmul(q8x16.pack_q8(v, 6), 6, 16, 32, x)
    assert torch.equal(got, torch.cat([_run(fused.parts[0], x), v_alone], 1))
    lin = QuantLinear(fused, None, None)
    assert lin.own_paths() == ("mixed",) and torch.equal(lin.run_own(x), got)


def test_q4x16_nibbles_are_q4ks():
    """The two layouts share csrc/q4_nibbles.h: the same packing of q."""
    w = q4_k_weights(40, 512)
    nib = q4x16.pack_nibbles(w.q)                               # [tiles, 16, 256]
    packed = q4k.pack_q4k(w)                                    # [tiles, 2, 2368]
    assert torch.equal(packed[..., 320:].reshape(nib.shape), nib)
