"""The quantization settings the quantized CPU runner serves, `quantization=` one of `MODES`:
what each makes of a projection's weight, whether the file's blocks (`verifier.model.gguf_blocks`)
or a dense tensor. Besides them: "none" (the checkpoint's weights, dense) and "auto" (the file
decides, `verifier.quantized.quantize.auto_quantization`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from verifier.model.quant import (Int4KWeight, Int4Weight, Int8KWeight, Int8Weight, QuantWeight, int4_group,
                                  quantize_int4, quantize_int8)

Q8_GROUP = 32       # weights per scale of a dense weight served as int8 blocks (as GGUF's Q8_0)


@dataclass(frozen=True)
class Mode:
    name: str
    serve: Callable[[QuantWeight | torch.Tensor], QuantWeight]    # a weight -> its served form
    scan: str                # the mode whose form scans the LM head's vocabulary (see RescoredHead)


def _dense(w: QuantWeight | torch.Tensor) -> torch.Tensor:
    return w.detach() if isinstance(w, torch.Tensor) else w.dequantize()


def _int4(w: QuantWeight | torch.Tensor) -> QuantWeight:
    """int4 blocks as stored (Q4_0, Q4_1, Q4_K); anything else requantized to int4 groups of 32."""
    if isinstance(w, (Int4Weight, Int4KWeight)):
        return w
    dense = _dense(w)
    return quantize_int4(dense, int4_group(dense.shape[1]))


def _int8(w: QuantWeight | torch.Tensor) -> QuantWeight:
    """int8 blocks as stored (the linear makes them per channel unless a kernel takes their
    groups); anything else requantized per channel."""
    return w if isinstance(w, (Int8Weight, Int8KWeight)) else quantize_int8(_dense(w))


def _gguf(w: QuantWeight | torch.Tensor) -> QuantWeight:
    """Each tensor on its own blocks, as llama.cpp serves it; a dense one as int8 blocks of 32."""
    return quantize_int8(w.detach(), Q8_GROUP) if isinstance(w, torch.Tensor) else w


REGISTRY: dict[str, Mode] = {m.name: m for m in (Mode("int4", _int4, "int4"), Mode("int8", _int8, "int8"),
                                                 Mode("gguf", _gguf, "int4"))}
MODES = tuple(REGISTRY)
