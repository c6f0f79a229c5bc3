"""Where the dense CPU matmul switches from MKL to oneDNN: timed at load, on the model's own
matmuls, and cached per machine.

`verifier.model.linear.Linear` runs thin inputs through MKL (`W @ x.T`) and the rest through oneDNN
with a packed weight. Which is faster at one, two or three rows depends on the CPU (figures:
docs/performance.md, "Matmul paths and quantized kernels"). So each path is timed over every
Linear of the model, as a forward streams them, at ROWS, and oneDNN takes every count from the
first one where it is at least as fast at every larger count timed.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verifier.cpu.machine import cached_measurement
from verifier.model.linear import Linear, cpu_linear, onednn_available, onednn_linear

FORMAT = 1
ROWS = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class LinearTimings:
    mkl_ms: dict[int, float]        # rows -> ms for every Linear of the model once, MKL
    onednn_ms: dict[int, float]     # the same through oneDNN
    onednn_from: int                # the row count from which oneDNN runs

    def to_json(self) -> dict:
        return {"mkl_ms": self.mkl_ms, "onednn_ms": self.onednn_ms, "onednn_from": self.onednn_from}

    @classmethod
    def from_json(cls, d: dict) -> "LinearTimings":
        as_rows = lambda m: {int(r): float(ms) for r, ms in m.items()}  # noqa: E731
        return cls(as_rows(d["mkl_ms"]), as_rows(d["onednn_ms"]), int(d["onednn_from"]))


def choose(mkl_ms: dict[int, float], onednn_ms: dict[int, float]) -> int:
    """The smallest row count from which oneDNN is at least as fast at every count timed; one past
    the last count when MKL wins at it (thin inputs are the only ones MKL's path is for)."""
    rows = sorted(mkl_ms)
    return next((r for r in rows if all(onednn_ms[s] <= mkl_ms[s] for s in rows if s >= r)), rows[-1] + 1)


@torch.inference_mode()
def measure(linears: list[Linear], rows: tuple[int, ...] = ROWS, repeats: int = 5) -> LinearTimings:
    """Median ms of one pass over `linears` per path and row count, the two paths interleaved."""
    gen = torch.Generator().manual_seed(0)
    samples: dict[str, dict[int, list[float]]] = {"mkl": {r: [] for r in rows}, "onednn": {r: [] for r in rows}}
    paths = {"mkl": lambda lin, x: cpu_linear(x, lin.weight, lin.bias),
             "onednn": lambda lin, x: onednn_linear(x, lin._packed_weight(), lin.bias)}
    for r in rows:
        xs = {n: torch.randn(r, n, generator=gen) for n in {lin.in_features for lin in linears}}
        for _ in range(repeats + 1):                          # the first pass warms both paths up
            for name, path in paths.items():
                t0 = time.perf_counter()
                for lin in linears:
                    path(lin, xs[lin.in_features])
                samples[name][r].append((time.perf_counter() - t0) * 1e3)
    med = {name: {r: round(statistics.median(s[1:]), 3) for r, s in cells.items()} for name, cells in samples.items()}
    return LinearTimings(med["mkl"], med["onednn"], choose(med["mkl"], med["onednn"]))


def tune(net: torch.nn.Module, cache_dir: Path | None, refresh: bool = False,
         threads: int | None = None) -> LinearTimings | None:
    """Time (or read this machine's cached timings for) the dense fp32 Linears of `net` and set
    their `onednn_from`; None where oneDNN is not built in or the weights are not fp32 on the CPU."""
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    if not linears or not onednn_available() or any(l.weight.device.type != "cpu" or l.weight.dtype != torch.float32
                                               for l in linears):
        return None
    key = {"format": FORMAT, "rows": list(ROWS), "shapes": [list(l.weight.shape) for l in linears]}
    timings = cached_measurement(cache_dir, "linear-", key, lambda: measure(linears), LinearTimings.to_json,
                                 LinearTimings.from_json, refresh, threads)
    for lin in linears:
        lin.onednn_from = timings.onednn_from
    return timings
