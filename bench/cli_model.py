"""`tercel bench kernels` and `tercel bench quality`: the quantized target on this machine.

    tercel bench kernels [--quantization int4]
        times the weights' own kernels over one layer at 1 to 512 rows (a load times 1 to 8,
        what its choice reads); prints them with the choice
    tercel bench quality [--quantization int4,int8] [--limit 30]
        top-1 agreement and perplexity ratio against quantization=none on held-out replies
"""
from __future__ import annotations

import sys

from bench.quality import quality_table, run_quality
from verifier.cpu import cpu_ops
from verifier.cpu.machine import machine_summary
from verifier.model.loader import DEFAULT_MODEL
from verifier.quantized.attention_tuning import NEVER
from verifier.quantized.matmul_paths import engine_rows
from verifier.quantized.runner import QuantizedRunner
from verifier.target import TargetModel


def run_model_bench(args) -> int:
    model = args.model or DEFAULT_MODEL
    modes = [q.strip() for q in args.quantization.split(",") if q.strip()]
    print(f"bench {args.what}: {model}, {machine_summary()}", file=sys.stderr)
    if args.what == "kernels":
        for mode in modes:
            print(kernels_report(model, mode, args))
        return 0
    if "none" in modes:
        raise ValueError("bench quality compares quantized modes with none; list int4, int8 or auto")
    print(quality_table(run_quality(model, modes, args.limit)))
    return 0


def kernels_report(model: str, mode: str, args) -> str:
    target = TargetModel(model, quantization=mode, kernel_rows=engine_rows(512), retime_kernels=True)
    if not isinstance(target.runner, QuantizedRunner):
        return f"quantization {target.quantization}: dense weights, no kernel choice to make"
    t, plan = target.runner.timings, target.runner.plan
    exact = plan.own            # the sampled rows' kernel
    paths = list(t.ms)
    lines = [f"quantization {target.quantization}: the matmuls of one layer, ms", "",
             "| rows | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    for m in t.rows:
        lines.append(f"| {m} | " + " | ".join("-" if t.ms[p].get(m) is None else f"{t.ms[p][m]:.2f}"
                                              for p in paths) + " |")
    probed = {True: "yes", False: "no", None: "not probed"}
    lines.append("| row-invariant | " + " | ".join(probed[t.invariant.get(p)] for p in paths) + " |")
    cliff = t.rows_before_cliff(exact)
    lines += ["", f"Every row (decode, verify and prompt rows) takes {exact}.",
              f"Verify steps stay within {cliff} rows where they can (the {exact} kernel's cost jumps above)."
              if cliff else f"No cost jump in the {exact} kernel up to 8 rows."]
    return "\n".join(lines + ["", attention_report(target.runner.attention_timings)])


def attention_report(a) -> str:
    """The fused attention's calls on one thread and on all, and the threshold chosen."""
    keys = sorted({k for _, k in a.serial})
    lines = ["Attention of one layer, us per call: one thread / all threads (-: below the first size "
             "all threads lost, not timed)", "",
             "| rows | " + " | ".join(f"{k} keys" for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for rows in sorted({r for r, _ in a.serial}):
        lines.append(f"| {rows} | " + " | ".join(f"{a.serial[rows, k]:.1f} / {a.parallel[rows, k]:.1f}"
                                                 if (rows, k) in a.serial else "-" for k in keys) + " |")
    lines += ["", "Attention stays on one thread at every size measured." if a.parallel_from == NEVER else
              f"Attention runs on all threads from {a.parallel_from} (rows x keys x query heads).",
              "Prompt rows attend on AMX tiles." if cpu_ops.attention_tiles() else
              "Prompt rows attend on vectors (no AMX tiles here)."]
    return "\n".join(lines)
