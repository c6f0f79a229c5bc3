"""The two registries behind the quantized path: GGUF block formats (`verifier.model.gguf_blocks`)
and the weights' own kernels (`verifier.quantized.own_kernels`). Every registered format reads
blocks exactly as gguf-py dequantizes them, and every registered kernel gives a row the same bits
alone or in a batch, close to the dequantized weights' product. A format or kernel added to a
registry is tested here as soon as it has an encoder (formats) or a weight it takes (kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quant_cases import activations, q4_k_weights, q6_k_bytes, q6_k_weights
from verifier.model.gguf_blocks import FORMATS, INT4_NATIVE, read_block_tensor
from verifier.model.quant import (Int4KWeight, Int4Weight, Int8KWeight, Int8Weight, StackedWeight, quantize_int4,
                                  quantize_int8)
from verifier.quantized.own_kernels import KERNELS, kernels_for
from verifier.quantized.qlinear import QuantLinear, served_weights

ROWS, COLS = 8, 512


def _q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks by the format's definition (gguf-py cannot write them): random scales, mins and
    nibbles under small fp16 d and dmin; `w` gives only the shape."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = (rng.random((w.shape[0], w.shape[1] // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


def _gguf_py(kind: str):
    def encode(w: np.ndarray) -> np.ndarray:
        import gguf
        from gguf.quants import quantize
        return quantize(w, gguf.GGMLQuantizationType[kind])
    return encode


# How a test writes each format's blocks: gguf-py's quantizer where it has one.
ENCODERS = {"Q4_0": _gguf_py("Q4_0"), "Q4_1": _gguf_py("Q4_1"), "Q5_0": _gguf_py("Q5_0"), "Q8_0": _gguf_py("Q8_0"),
            "Q4_K": _q4_k_bytes, "Q6_K": q6_k_bytes}


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_every_registered_format_reads_as_gguf_py_dequantizes_it(kind):
    import gguf
    from gguf.quants import dequantize
    assert kind in ENCODERS, f"{kind} is registered but this test cannot write its blocks: add an encoder"
    fmt, qtype = FORMATS[kind], gguf.GGMLQuantizationType[kind]
    assert (fmt.weights, fmt.nbytes) == gguf.GGML_QUANT_SIZES[qtype]
    w = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    data = ENCODERS[kind](w)
    ours = read_block_tensor(kind, data, ROWS, COLS)
    assert isinstance(ours, fmt.form) and ours.shape == (ROWS, COLS)
    want = dequantize(data, qtype).reshape(ROWS, COLS)
    assert np.array_equal(ours.dequantize().numpy(), want), kind


def test_the_int4_native_formats_are_those_read_as_int4():
    assert INT4_NATIVE == {"Q4_0", "Q4_1", "Q4_K"}
    assert {FORMATS[k].form for k in INT4_NATIVE} == {Int4Weight, Int4KWeight}
    assert all(FORMATS[k].form in (Int8Weight, Int8KWeight) for k in set(FORMATS) - INT4_NATIVE)


def _weights() -> list:
    """Weights of every served form and grouping a kernel may take: int4 groups of 32, int8 per
    channel, int8 groups of 32 (Q8_0's, Q5_0's) and of 16 (Q6_K's, 6 bits), Q4_K's own, and fused
    parts of several forms."""
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    six_bit = quantize_int8(w, 16)
    six_bit = Int8Weight(six_bit.q.clamp(-32, 31), six_bit.scale)
    q4_k, q6_k = q4_k_weights(24, 256), q6_k_weights(24, 256)
    stacked = StackedWeight((quantize_int4(w[:16], 32), quantize_int8(w[16:], 32), q4_k, q6_k))  # every part kind
    return [quantize_int4(w, 32), quantize_int8(w), quantize_int8(w, 32), six_bit, q4_k, q6_k, stacked]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_registered_kernel_is_row_invariant_and_computes_its_weights_product(name):
    kernel = KERNELS[name]
    taken = [w for w in _weights() if isinstance(w, kernel.form) and kernel.offered(w)]
    if not taken:
        pytest.skip(f"{name} takes none of these weights on this machine")
    x = activations(7, 256)
    for w in taken:
        served = served_weights(w)
        args = kernel.pack(served).args
        n = w.shape[0]
        y = kernel.mm(x, *args)[:, :n]
        for i in range(x.shape[0]):
            assert torch.equal(kernel.mm(x[i:i + 1].contiguous(), *args)[:, :n], y[i:i + 1]), (name, i)
        want = x.float() @ served.dequantize().T
        assert (y.float() - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, name
        lin = QuantLinear(w, None, None)
        assert name in lin.own_paths()
        lin.use_own(name)                                   # the linear runs the kernel it names
        assert torch.equal(lin.run_own(x), y)


def test_each_kernel_has_its_own_native_loop_kind():
    """One kind per kernel, but for the parts runner's (64): q4k runs as a weight of one part."""
    kinds = {}
    for w in _weights():
        for k in kernels_for(w)[1]:
            kinds.setdefault(k.loop(k.pack(served_weights(w))).kind, set()).add(k.name)
    assert kinds.pop(64) == {"mixed", "q4k"}
    assert all(len(names) == 1 for names in kinds.values()), kinds


def test_an_int8_weight_no_kernel_takes_goes_per_channel():
    w = quantize_int8(torch.randn(16, 96), 48)          # groups of 48: no kernel's
    served, owns = kernels_for(w)
    assert served.group == 96 and [k.name for k in owns] == ["int8"]
