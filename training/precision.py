"""The training dtype: fp32 or bf16 autocast, as asked, or ("auto") whichever trains faster here.

Which is faster depends on the machine, not on the code: bf16 matmuls run on AMX tiles on a
Xeon that has them and are emulated several times slower on a CPU without bf16 instructions
(docs/performance.md, "bf16 against fp32"). So `auto` times one short training step in each
(forward and backward, after a warm-up) and keeps the faster; CUDA takes bf16 without timing.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("tercel.training")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROBE_TOKENS = 512      # the probe is the example nearest this long: seconds even where bf16 is slow


def autocast(device: torch.device | str, dtype: torch.dtype):
    """The context a training step runs in: bf16 autocast, or nothing for fp32."""
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def label(dtype: torch.dtype) -> str:
    """The dtype as a training summary states it ("float32", "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def probe_example(lengths: list[int]) -> list[int]:
    """The probe batch: one example, the one nearest PROBE_TOKENS long."""
    return [min(range(len(lengths)), key=lambda i: abs(lengths[i] - PROBE_TOKENS))]


def choose(setting: str, device: torch.device | str, step: Callable[[torch.dtype], torch.Tensor],
           params: list[torch.nn.Parameter], repeats: int = 2) -> torch.dtype:
    """The dtype to train in. `step(dtype)` returns a probe batch's loss computed in that dtype;
    for "auto" on the CPU each dtype runs it (and its backward) once to warm up, then `repeats`
    times, the fastest run counting. The probe's gradients are discarded."""
    if setting != "auto":
        return DTYPES[setting]
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    seconds = {name: _fastest(step, dtype, params, repeats) for name, dtype in DTYPES.items()}
    name = min(seconds, key=seconds.get)
    log.info("training dtype %s: a probe step took %s", name,
             ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in seconds.items()))
    return DTYPES[name]


def _fastest(step, dtype: torch.dtype, params: list[torch.nn.Parameter], repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        step(dtype).backward()
        if i:                                   # the first run warms kernels and allocations
            best = min(best, time.perf_counter() - start)
        for p in params:
            p.grad = None
    return best
