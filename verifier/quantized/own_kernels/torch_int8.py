"""torch's int8 kernel (`_weight_int8pack_mm`): one scale per output channel, bf16 activations;
any CPU."""
import torch

from verifier.model.quant import Int8Weight, QuantWeight
from verifier.quantized.own_kernels.base import LoopFields, OwnKernel, Packed

_MM = torch._weight_int8pack_mm     # torch's own binding, as torch_int4's


def offered(w: QuantWeight) -> bool:
    return w.group == w.shape[1]


def pack(w: Int8Weight) -> Packed:
    return Packed((w.q.contiguous(), w.scale[:, 0].to(torch.bfloat16).contiguous()), 8)    # q, scale [N]


def loop(p: Packed) -> LoopFields:
    q, scale = p.args
    return LoopFields(8, q, scale)


KERNEL = OwnKernel("int8", Int8Weight, offered, pack, _MM, loop)
