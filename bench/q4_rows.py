"""The decoder matmuls of one forward on each int4 kernel, by row count, interleaved.

    python -m bench.q4_rows [--rows 1,2,3,4,6,8] [--repeats 10] [--threads 2]

30 layers of SmolLM2-135M shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
with random int4 weights, each layer its own weights, so they stream from memory as in a
forward. Every repeat times torch's int4 kernel and Tercel's q4x16 (csrc/q4_matmul.c) one after
the other at each row count; medians over repeats, and the median of their per-repeat ratio.
`tercel bench kernels` times the real model's weights, one path after the other.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from verifier.cpu import cpu_ops
from verifier.cpu.machine import machine_summary
from verifier.model.quant import quantize_int4
from verifier.quantized.qlinear import QuantLinear

HIDDEN, INTER, LAYERS = 576, 1536, 30
SHAPES = ((960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
PATHS = ("int4", "q4x16")


def layers() -> list[QuantLinear]:
    g = torch.Generator().manual_seed(0)
    return [QuantLinear(quantize_int4(torch.randn(n, k, generator=g) * 0.02, 32), None, None)
            for _ in range(LAYERS) for n, k in SHAPES]


@torch.inference_mode()
def time_rows(lins: list[QuantLinear], m: int, repeats: int) -> dict[str, list[float]]:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (HIDDEN, INTER)}
    ms: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(repeats + 1):                 # the first repeat warms code and allocations
        for path in PATHS:
            start = time.perf_counter()
            for lin in lins:
                lin.run(path, xs[lin.in_features])
            if i:
                ms[path].append((time.perf_counter() - start) * 1e3)
    return ms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available() or not cpu_ops.q4_isa():
        raise SystemExit("q4x16 is not built on this machine (it needs AVX2 or AVX-512 VNNI and a C compiler)")
    print(f"q4_rows: {machine_summary()}, q4x16 on {cpu_ops.q4_isa()}-bit vectors, {args.repeats} repeats")
    lins = layers()
    print("\n| rows | int4 ms | q4x16 ms | q4x16 / int4 |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        ms = time_rows(lins, m, args.repeats)
        ratio = statistics.median(q / t for q, t in zip(ms["q4x16"], ms["int4"]))
        print(f"| {m} | {statistics.median(ms['int4']):.2f} | {statistics.median(ms['q4x16']):.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
