"""The decoder matmuls of one forward on q4x16, q4k and on q8x16 at 5, 6 and 8 bits, by row count.

    python -m bench.q8_rows [--rows 1,4,8] [--repeats 7] [--threads 2] [--shapes smollm2|wide]

bench/q4_rows.py's shapes (30 layers of SmolLM2-135M, each its own random weights, so they
stream from memory as in a forward), or `wide`'s (12 layers, hidden 1024, MLP 2816, k and v 256
each: bench/kquant_files.py's model, whose widths are multiples of 256 as Q4_K needs): q4x16 on
int4 groups of 32 (Q4_0/Q4_1), q4k on Q4_K's own blocks (wide only), q8x16 on 5-bit groups of
32 (Q5_0), 6-bit groups of 16 (Q6_K) and 8-bit groups of 32 (Q8_0). Every repeat times each
format one after the other; medians over repeats, the megabytes each streams, and the rate it
streams them at.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import q4_rows
from verifier.cpu import cpu_ops
from verifier.cpu.machine import machine_summary
from verifier.model.quant import Int4KWeight, Int8Weight, quantize_int4
from verifier.quantized.qlinear import QuantLinear, served_weights

FORMATS = {"q4x16 (4 bits)": None, "q4k (Q4_K)": "q4k", "q8x16 5 bits": (5, 32), "q8x16 6 bits": (6, 16),
           "q8x16 8 bits": (8, 32)}
# (layers, hidden, MLP width, matmul shapes (N, K))
MODELS = {"smollm2": (q4_rows.LAYERS, q4_rows.HIDDEN, q4_rows.INTER, q4_rows.SHAPES),
          "wide": (12, 1024, 2816, ((1536, 1024), (1024, 1024), (2 * 2816, 1024), (1024, 2816)))}


def _weight(n: int, k: int, fmt: tuple[int, int] | str | None, g: torch.Generator):
    if fmt is None:
        return quantize_int4(torch.randn(n, k, generator=g) * 0.02, 32)
    if fmt == "q4k":
        byte = lambda hi, cols: torch.randint(0, hi, (n, cols), generator=g, dtype=torch.uint8)  # noqa: E731
        half = lambda: (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()              # noqa: E731
        return Int4KWeight(byte(16, k), byte(64, k // 32), byte(64, k // 32), half(), half())
    bits, group = fmt
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=g, dtype=torch.int8)
    return served_weights(Int8Weight(q, torch.rand(n, k // group, generator=g) * 0.01))


def layers(fmt, model: str) -> list[QuantLinear]:
    g = torch.Generator().manual_seed(0)
    count, _, _, shapes = MODELS[model]
    lins = [QuantLinear(_weight(n, k, fmt, g), None, None) for _ in range(count) for n, k in shapes]
    for lin in lins:
        lin.use_own("q4x16" if fmt is None else "q4k" if fmt == "q4k" else "q8x16")
        lin.drop_other_owns()
    return lins


def megabytes(lins: list[QuantLinear]) -> float:
    return sum(lin.own_mm[1][0].numel() for lin in lins) / 1e6


@torch.inference_mode()
def time_rows(formats: dict[str, list[QuantLinear]], m: int, repeats: int) -> dict[str, list[float]]:
    widths = {lin.in_features for lins in formats.values() for lin in lins}
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in widths}
    ms: dict[str, list[float]] = {f: [] for f in formats}
    for i in range(repeats + 1):                 # the first repeat warms code and allocations
        for name, lins in formats.items():
            start = time.perf_counter()
            for lin in lins:
                lin.run_own(xs[lin.in_features])
            if i:
                ms[name].append((time.perf_counter() - start) * 1e3)
    return ms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", choices=sorted(MODELS), default="smollm2")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available() or not cpu_ops.q4_isa():
        raise SystemExit("the integer kernels are not built on this machine (AVX2 or AVX-512 VNNI and a C compiler)")
    print(f"q8_rows: {machine_summary()}, {cpu_ops.q4_isa()}-bit vectors, {args.repeats} repeats")
    wide_enough = MODELS[args.shapes][1] % 256 == 0         # Q4_K needs widths in multiples of 256
    formats = {name: layers(fmt, args.shapes) for name, fmt in FORMATS.items() if fmt != "q4k" or wide_enough}
    size = {name: megabytes(lins) for name, lins in formats.items()}
    print("\n| rows | format | MB | ms | GB/s |\n|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        for name, t in time_rows(formats, m, args.repeats).items():
            ms = statistics.median(t)
            print(f"| {m} | {name} | {size[name]:.1f} | {ms:.2f} | {size[name] / ms:.1f} |")


if __name__ == "__main__":
    main()
