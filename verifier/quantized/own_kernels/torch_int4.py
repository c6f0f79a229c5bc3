"""torch's int4 kernel (`_weight_int4pack_mm_for_cpu`), bf16 activations; any CPU."""
import torch
import torch.nn.functional as F

from verifier.model.quant import Int4Weight
from verifier.quantized.own_kernels.base import LoopFields, OwnKernel, Packed

_N_ALIGN = 16          # the packer needs a multiple of 16 output channels
# torch's own binding: a call through torch.ops.aten costs more (docs/performance.md, "Matmul
# paths and quantized kernels")
_MM = torch._weight_int4pack_mm_for_cpu


def pack(w: Int4Weight) -> Packed:
    pad = -w.shape[0] % _N_ALIGN
    q, scale, zero = w.q, w.scale, w.zero
    if pad:     # zero rows (scale 0, zero 0) give zero outputs, sliced off after the matmul
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, zero))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    # [K / group, N, 2] (scale, zero) in bf16: the kernel's layout and dtype
    scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    return Packed((packed, w.group, scale_zero), 4)


def loop(p: Packed) -> LoopFields:
    packed, group, scale_zero = p.args
    return LoopFields(4, packed, scale_zero, group)


KERNEL = OwnKernel("int4", Int4Weight, lambda w: True, pack, _MM, loop)
