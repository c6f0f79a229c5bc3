"""GGUF's Q6_K on its own scales (csrc/q8_matmul.c with group 256, path "q8x16"): int8 scales per 16
weights under an fp16 d per 256, d * sc exact in fp32. The vector code is bitwise its scalar
reference on both instruction sets, a row's output does not depend on the other rows, the result
is x @ W.T on the file's weights, and the loader keeps the form where the kernel takes it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from quant_cases import activations, assert_near_product, avx2_q8_matmul, extreme_activations, q6_k_weights
from verifier.cpu import cpu_ops
from verifier.model.quant import Int8KWeight, Int8Weight
from verifier.quantized import own_kernels
from verifier.quantized.own_kernels import q8x16
from verifier.quantized.own_kernels.q8x16 import pack_q8
from verifier.quantized.qlinear import QuantLinear
from verifier.quantized.quantize import _table

pytestmark = pytest.mark.skipif(not cpu_ops.available() or not cpu_ops.q4_isa(),
                                reason="q8x16 is built for AVX2 or AVX-512 VNNI")


def _run(w: Int8KWeight, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    return cpu_ops.q8_matmul(pack_q8(w), 6, 256, w.shape[0], x, reference=reference)


@pytest.mark.parametrize("n, k", [(16, 256), (40, 512), (200, 1536)])
def test_vector_path_is_bitwise_the_scalar_reference(n, k):
    w, x = q6_k_weights(n, k), activations(17, k)
    assert torch.equal(_run(w, x), _run(w, x, reference=True))


def test_a_row_is_the_same_alone_and_among_others():
    w, x = q6_k_weights(96, 768), activations(17, 768)
    full = _run(w, x)
    for i in range(17):
        assert torch.equal(_run(w, x[i:i + 1].contiguous())[0], full[i]), f"row {i}"


def test_result_is_the_files_weights_product():
    """Against x @ W.T in float64 on the file's weights (d * sc exact). A layout read differently
    from `pack_q8` (a d of another super-block, scales of another half or channel) is far off."""
    w, x = q6_k_weights(200, 768, seed=3), activations(6, 768)
    assert_near_product(_run(w, x), x.double() @ w.dequantize().double().t())


def test_the_bytes_are_the_files_and_the_int8_form_the_same_weights():
    w = q6_k_weights(40, 512)
    assert pack_q8(w).shape == (3, 2, 32 + 8 * (256 + 128 + 32))      # 6.56 bits a weight, as the file's
    assert torch.equal(w.as_grouped().dequantize(), w.dequantize())


def test_the_avx2_build_gives_the_same_bits():
    run = avx2_q8_matmul()
    w, x = q6_k_weights(72, 1536, seed=5), activations(11, 1536)
    assert torch.equal(run(pack_q8(w, masks=False), 6, 256, 72, x), _run(w, x))
    x = extreme_activations(256)                          # the integer sums' worst cases
    w = Int8KWeight(torch.full((32, 256), 31, dtype=torch.int8), torch.full((32, 16), 127, dtype=torch.int8),
                    torch.full((32, 1), 1e-3).half().float())
    w.q[16:] = -32
    assert torch.equal(run(pack_q8(w, masks=False), 6, 256, 32, x), _run(w, x, reference=True))


def test_a_linear_serves_q6_k_on_its_own_scales_and_the_int8_form_elsewhere(monkeypatch):
    w = q6_k_weights(64, 512)
    lin = QuantLinear(w, None, None)
    assert lin.own_paths() == ("q8x16",) and lin.kind == "int8" and lin.loop_fields().group == 256
    x = activations(3, 512)
    assert torch.equal(lin.run_own(x), _run(w, x))
    no_kernel = dataclasses.replace(q8x16.KERNEL, offered=lambda w: False)
    monkeypatch.setitem(own_kernels.KERNELS, "q8x16", no_kernel)
    served, owns = own_kernels.kernels_for(w)
    assert isinstance(served, Int8Weight) and [k.name for k in owns] == ["int8"]      # per channel, as before


def test_a_q6_k_embedding_is_held_in_the_int8_form():
    """The C lookup and rescoring take int8 groups: the table is the same weights in that form."""
    w = q6_k_weights(64, 256)
    table = _table(w, torch.zeros(64, 256))
    assert isinstance(table, Int8Weight) and torch.equal(table.dequantize(), w.dequantize())
