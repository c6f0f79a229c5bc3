"""The parts runner (csrc/mixed_matmul.c) as a kernel's call and native-loop entry: a weight packed
as its parts' layouts one after another, with their table (rows, bits, group), runs through
`cpu_ops.mixed_matmul` and the loop's kind 64. The mixed kernel's weights take it, and so does q4k's
(a weight of one part), whose layout has no entry point of its own."""
import torch

from verifier.cpu import cpu_ops
from verifier.quantized.own_kernels.base import LoopFields, Packed

LOOP_KIND = 64      # decode_loop.cpp's Linear kind for the parts runner


def mm(x: torch.Tensor, packed: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_ops.mixed_matmul(packed, table, n, x)


def loop(p: Packed) -> LoopFields:
    packed, table, _ = p.args
    return LoopFields(LOOP_KIND, packed, table)
