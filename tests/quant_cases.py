"""Weights and activations for the integer kernels' tests, and their checks: the activations
every kernel test runs (tests/kernels/test_q4.py and the others), random weights in each stored
form (int8 groups, Q4_K, Q6_K), GGUF's K-quant blocks written by the formats' definitions
(gguf-py has no Q4_K or Q6_K quantizer), the AVX2 build of q8_matmul, the product check against
x @ W.T, and the native decode loop against the Python one."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from verifier.cpu import cpu_ops
from verifier.model.quant import Int4KWeight, Int8KWeight, Int8Weight
from verifier.quantized.qlinear import served_weights


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """bf16 rows of mixed scale, with an all-zero block and an outlier (as after a norm)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]
    x[0, :32] = 0
    x[-1, 5] = 40.0
    return x.to(torch.bfloat16)


def assert_near_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` (a kernel's bf16 output) against x @ W.T in float64: within the 15-bit activations'
    error, where a layout read wrongly (a scale of another block or channel) is far off."""
    got, want = got.double(), want.double()
    rel = (got - want).abs() / want.abs().clamp_min(1e-3 * want.abs().max())
    assert rel.median() < 2 ** -9 and ((got - want).norm() / want.norm()) < 3e-3


def extreme_activations(k: int) -> torch.Tensor:
    """4 bf16 rows whose digits sit at their extremes: the integer sums' worst cases."""
    x = torch.empty(4, k)
    x[0] = 1.0                                       # X = 32512 everywhere: hi digits 127
    x[1] = -1.0                                      # hi digits -127
    x[2] = -128 / 32512                              # lo digits -128 under one maximum
    x[2, ::32] = 1.0
    x[3] = torch.tensor([1.0, -1.0]).repeat(k // 2)  # alternating signs
    return x.to(torch.bfloat16)


def int8_weights(n: int, k: int, bits: int, group: int, seed: int = 0) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([-(1 << (bits - 1)), (1 << (bits - 1)) - 1])      # both ends of the range
    return served_weights(Int8Weight(q, torch.rand(n, k // group, generator=g) * 0.01))


def avx2_q8_matmul():
    """q8_matmul from the same source built without AVX-512 (the AVX2 path)."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    path = cpu_ops.compile_library(cpu_ops.INTEGER_MATMULS,
                                   [*cpu_ops.FLAGS, "-mno-avx512f", "-lm"], ("CC", "cc", "gcc"), salt="avx2",
                                   headers=cpu_ops.HEADERS)
    lib = ctypes.CDLL(str(path))
    lib.q4_isa.restype = lib.q8_matmul.restype = ctypes.c_int64
    lib.q8_matmul.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    assert lib.q4_isa() == 256

    def run(packed: torch.Tensor, bits: int, group: int, n: int, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        assert lib.q8_matmul(packed.data_ptr(), bits, group, n, x.shape[1], x.data_ptr(), x.shape[0],
                             out.data_ptr()) == 0
        return out
    return run


def q4_k_weights(n: int, k: int, seed: int = 0, q_max: int = 16, sc_max: int = 64) -> Int4KWeight:
    """Random Q4_K weights: nibbles, 6-bit scales and mins, fp16 d and dmin (values as a file's)."""
    g = torch.Generator().manual_seed(seed)
    byte = lambda hi, cols: torch.randint(0, hi, (n, cols), generator=g, dtype=torch.uint8)  # noqa: E731
    half = lambda: (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()              # noqa: E731
    return Int4KWeight(byte(q_max, k), byte(sc_max, k // 32), byte(sc_max, k // 32), half(), half())


def q6_k_weights(n: int, k: int, seed: int = 0) -> Int8KWeight:
    """Random Q6_K weights: q in -32..31 (both ends present), int8 scales, fp16 d (values as a file's)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([-32, 31])
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    return Int8KWeight(q, sc, (torch.rand(n, k // 256, generator=g) * 1e-3).half().float())


def q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K a multiple of 256) -> Q4_K blocks [N, K / 256 * 144]: per 32 weights a 6-bit
    scale and min of d and dmin (fp16, per 256), q in 0..15 with w ~ (d * sc) q - dmin * mn."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 8, 32)
    lo = np.minimum(g.min(-1), 0)
    step, low = (g.max(-1) - lo) / 15, -lo                          # [N, nsb, 8]
    d, dmin = ((t.max(-1) / 63).astype(np.float16) for t in (step, low))
    d32, dmin32 = (np.where(t > 0, t.astype(np.float32), 1)[..., None] for t in (d, dmin))
    sc = np.clip(np.round(step / d32), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(low / dmin32), 0, 63).astype(np.uint8)
    q = np.clip(np.round((g + (dmin32 * mn)[..., None]) / (d32 * sc)[..., None]), 0, 15).astype(np.uint8)
    q = q.reshape(n, k // 256, 4, 2, 32)                            # chunk c: weights 64 c + l, 64 c + 32 + l
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, -1, 128)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1)
    halves = np.stack([d, dmin], -1).view(np.uint8)
    return np.concatenate([halves, scales, qs], -1).reshape(n, -1)


def q6_k_bytes(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K a multiple of 256) -> Q6_K blocks [N, K / 256 * 210]: per 16 weights an int8
    scale of d (fp16, per 256), q in 0..63 with w ~ d * sc * (q - 32)."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 16, 16)
    group = np.abs(g).max(-1) / 31                                   # [N, nsb, 16]
    d = (group.max(-1) / 127).astype(np.float16)
    d32 = np.where(d > 0, d.astype(np.float32), 1)
    sc = np.clip(np.round(group / d32[..., None]), -128, 127).astype(np.int8)
    step = d32[..., None] * np.where(sc != 0, sc, 1)
    q = (np.clip(np.round(g / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)
    ql = np.concatenate([q[:, :, :, 0] | (q[:, :, :, 2] << 4), q[:, :, :, 1] | (q[:, :, :, 3] << 4)], -1)
    qh = sum((q[:, :, :, j] >> 4) << (2 * j) for j in range(4)).astype(np.uint8)
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8).reshape(n, -1, 2)], -1)
    return blocks.reshape(n, -1)


def assert_loops_agree(results) -> None:
    """The same forward through the native loop and the Python loop (logits, taps, the KV pools
    after it, per loop): equal bit for bit."""
    (logits, taps, k, v), (logits_py, taps_py, k_py, v_py) = results
    assert torch.equal(logits, logits_py)
    assert taps.keys() == taps_py.keys() and all(torch.equal(taps[i], taps_py[i]) for i in taps)
    assert torch.equal(k, k_py) and torch.equal(v, v_py)
