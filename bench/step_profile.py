"""Where a plain decode step goes: matmul kernels against everything else.

    python -m bench.step_profile --quantization auto,none --threads 2 --context 300

One request decodes greedily past a `--context`-token prompt (held-out text). The step's wall
time is the median of engine steps without a profiler; the matmul time is the self time of
the matmul kernels (int4 / int8 / oneDNN / MKL) in torch.profiler runs of as many steps,
alternated with them (`--rounds` of `--steps` each, medians). Everything else (norms, RoPE,
attention, sampling, the engine's Python) is the difference. The fused attention of the
native decode loop (`tercel::attention`, with its KV prefetch) is shown apart from the rest:
its two products over the KV cache are matmuls too, which the dense path's attention runs as
`aten::bmm` (counted there among the matmuls); the last column leaves it out. The table of
the profiler's top operators follows with --ops.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.prefill import long_prompt
from spec import LLM, SamplingParams

MATMUL_OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION_OPS = ("tercel::attention", "tercel::prefetch_kv")


def profile_step(llm: LLM, prompt: list[int], steps: int, rounds: int, show_ops: bool) -> dict:
    """Rounds of `steps` timed steps then `steps` profiled ones; medians over all of them."""
    engine = llm.engine
    engine.add_request("profile", prompt, SamplingParams(temperature=0, max_tokens=2 * rounds * steps + 20,
                                                         ignore_eos=True))
    for _ in range(10):                      # prefill and warm-up steps
        engine.step()
    walls, matmuls, attention = [], [], []
    for _ in range(rounds):
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        ops = prof.key_averages()
        matmuls.append(sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS) / steps / 1e3)
        attention.append(sum(e.self_cpu_time_total for e in ops if e.key in ATTENTION_OPS) / steps / 1e3)
    engine.abort("profile")
    engine.step()
    if show_ops:
        print(ops.table(sort_by="self_cpu_time_total", row_limit=15))
    wall, matmul = statistics.median(walls) * 1e3, statistics.median(matmuls)
    return {"step_ms": wall, "matmul_ms": matmul, "other_ms": wall - matmul, "attention_ms": statistics.median(attention)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto,none")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", action="store_true", help="print the profiler's top operators")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"plain decode step at a {args.context}-token context, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} rounds of {args.steps} steps\n\n| quantization | step ms | matmul kernels ms | "
          "everything else ms | of it, fused attention ms | everything else | everything else but the attention |\n"
          "|---|---|---|---|---|---|---|")
    for mode in args.quantization.split(","):
        llm = LLM(quantization=mode.strip(), max_num_seqs=1)
        r = profile_step(llm, long_prompt(llm, args.context), args.steps, args.rounds, args.ops)
        rest = r["other_ms"] - r["attention_ms"]
        print(f"| {mode} ({llm.engine.target.quantization}) | {r['step_ms']:.2f} | {r['matmul_ms']:.2f} | "
              f"{r['other_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms'] / r['step_ms']:.0%} | "
              f"{rest / r['step_ms']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
