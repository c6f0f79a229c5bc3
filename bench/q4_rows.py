"""The decoder matmuls of one forward on each int4 kernel, by row count, interleaved.

    python -m bench.q4_rows [--rows 1,2,3,4,6,8] [--repeats 10] [--threads 2] [--peak]

30 layers of SmolLM2-135M shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
with random int4 weights, each layer its own weights, so they stream from memory as in a
forward. Every repeat times torch's int4 kernel and Tercel's q4x16 (csrc/q4_matmul.c) one after
the other at each row count; medians over repeats, and the median of their per-repeat ratio.
`--peak` (AVX-512 VNNI builds) sets an extra row's integer products beside the machine's own
rate for them: q4x16 multiplies a row by each weight with two `vpdpbusd` (one per activation
digit, 64 products each), and a loop of nothing but independent `vpdpbusd` on registers, built
here with the C compiler, times how many the cores issue a second.
`tercel bench kernels` times the real model's weights, one path after the other.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

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


# Ten independent accumulators: more than a vpdpbusd's latency times its issue rate on the
# machines here, so the loop is bound by issue alone.
PEAK_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    #pragma omp parallel
    for (long i = 0; i < n; i++)
        __asm__ volatile(
            "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n\tvpdpbusd %%zmm30, %%zmm31, %%zmm1\n\t"
            "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n\tvpdpbusd %%zmm30, %%zmm31, %%zmm3\n\t"
            "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n\tvpdpbusd %%zmm30, %%zmm31, %%zmm5\n\t"
            "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n\tvpdpbusd %%zmm30, %%zmm31, %%zmm7\n\t"
            "vpdpbusd %%zmm30, %%zmm31, %%zmm8\n\tvpdpbusd %%zmm30, %%zmm31, %%zmm9\n\t"
            ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9");
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9);
    return 0;
}
"""


def vnni_peak(threads: int, n: int = 50_000_000) -> float:
    """vpdpbusd (512-bit) a second on `threads` threads in all, best of 3."""
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.c", Path(d) / "peak"
        src.write_text(PEAK_C)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx512f", "-mavx512vnni", "-fopenmp", str(src),
                        "-o", str(exe)], check=True, capture_output=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        best = min(float(subprocess.run([str(exe), str(n)], env=env, check=True, capture_output=True,
                                        text=True).stdout) for _ in range(3))
    return 10 * n * threads / best


def row_products(lins: list[QuantLinear]) -> int:
    """vpdpbusd per row through every weight: two digits x out x in / 64 products each."""
    return sum(2 * lin.out_features * lin.in_features // 64 for lin in lins)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak", action="store_true", help="an extra row's vpdpbusd rate against the machine's")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available() or not cpu_ops.q4_isa():
        raise SystemExit("q4x16 is not built on this machine (it needs AVX2 or AVX-512 VNNI and a C compiler)")
    print(f"q4_rows: {machine_summary()}, q4x16 on {cpu_ops.q4_isa()}-bit vectors, {args.repeats} repeats")
    lins = layers()
    print("\n| rows | int4 ms | q4x16 ms | q4x16 / int4 |\n|---|---|---|---|")
    q4 = {}
    for m in (int(r) for r in args.rows.split(",")):
        ms = time_rows(lins, m, args.repeats)
        ratio = statistics.median(q / t for q, t in zip(ms["q4x16"], ms["int4"]))
        q4[m] = statistics.median(ms["q4x16"])
        print(f"| {m} | {statistics.median(ms['int4']):.2f} | {q4[m]:.2f} | {ratio:.2f} |")
    if args.peak and (cpu_ops.q4_isa() != 512 or len(q4) < 2):
        print("\n--peak needs the AVX-512 VNNI build of q4x16 and two row counts or more")
    elif args.peak:
        lo, hi = min(q4), max(q4)
        row_ms = (q4[hi] - q4[lo]) / (hi - lo)
        rate, peak = row_products(lins) / row_ms * 1e3, vnni_peak(args.threads)
        print(f"\nan extra row ({lo} to {hi} rows): {row_ms:.2f} ms, {rate / 1e9:.2f} G vpdpbusd/s against "
              f"{peak / 1e9:.2f} G/s issued by a register-only loop on {args.threads} threads ({rate / peak:.0%})")


if __name__ == "__main__":
    main()
