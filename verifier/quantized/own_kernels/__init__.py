"""The weights' own kernels, one module per kernel, each defining KERNEL (`base.OwnKernel`: the
form it multiplies, whether it takes a weight here, its packing, its call, its native-loop
entry). A `QuantLinear` holds every kernel of `KERNELS` that takes its weight; the `KernelPlan`
chooses among them by measurement. `base` and `parts` (the parts runner's call and loop entry,
which mixed and q4k share) define no kernel.

Adding a kernel: a module here, its name in `_MODULES` (the order is the default's preference),
its C source beside the others with its kind in decode_loop.cpp, and a test of its bits
(docs/quantization.md, "Adding a format").
"""
from __future__ import annotations

from verifier.model.quant import Int8Weight, KQuantWeight, QuantWeight, per_channel
from verifier.quantized.own_kernels import mixed, q4k, q4x16, q8x16, torch_int4, torch_int8
from verifier.quantized.own_kernels.base import OwnKernel

_MODULES = (torch_int4, q4x16, torch_int8, q8x16, q4k, mixed)
KERNELS: dict[str, OwnKernel] = {m.KERNEL.name: m.KERNEL for m in _MODULES}
OWN_PATHS = frozenset(KERNELS)     # the weights' own (row-invariant) matmul paths; the other paths are dense


def kernels_for(w: QuantWeight) -> tuple[QuantWeight, list[OwnKernel]]:
    """The kernels that take `w` here, in `KERNELS`' order, and the weight they take: an int8
    weight in groups that no kernel takes is requantized per channel (torch's int8 kernel takes
    any such weight); Q4_K and Q6_K blocks where their kernels are not built take the int4 and int8
    forms (exact)."""
    owns = [k for k in KERNELS.values() if isinstance(w, k.form) and k.offered(w)]
    if not owns and isinstance(w, Int8Weight) and w.group != w.shape[1]:
        return kernels_for(per_channel(w))
    if not owns and isinstance(w, KQuantWeight):
        return kernels_for(w.as_grouped())
    return w, owns
