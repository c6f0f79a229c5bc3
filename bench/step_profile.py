"""Where a plain decode step goes: matmul kernels against everything else.

    python -m bench.step_profile --quantization auto,none --threads 2 --context 300

One request decodes greedily past a `--context`-token prompt (held-out text), `--rounds` x
`--steps` steps after a warm-up; medians. Where the target runs the native decode loop (the
quantized default), every step is timed by the wall clock and by the loop's own clocks
(`verifier.quantized.cpu_loop.step_clock`: its time in matmul calls, each whole with its output
allocation, and in attention), so both figures come from the same step; a profiler's
overhead and its window (profiled steps alternated with timed ones) moved the share by +-4
points between runs on a shared 2-vCPU machine. Elsewhere (`none`, or with --ops, which prints
the profiler's top operators) the matmul time is that of the matmul operators (int4 / int8 /
oneDNN / MKL calls, each whole, an operator inside another counted once) in torch.profiler
runs alternated with timed ones. Everything else (norms, RoPE, attention, sampling, the
engine's Python) is the difference. The fused attention (with its KV prefetch) is shown apart
from the rest: its two products over the KV cache are matmuls too, which the dense path runs
as `aten::bmm` (counted there among the matmuls); the last column leaves it out.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.prefill import long_prompt
from spec import LLM, SamplingParams, Submission
from verifier.quantized.cpu_loop import step_clock

MATMUL_OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "tercel::q4_matmul",
              "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION_OPS = ("tercel::attention", "tercel::prefetch_kv")


def _outermost_ms(events, names: tuple[str, ...]) -> float:
    """Milliseconds in calls of the named operators, each counted whole (its output
    allocation included) and once: a call inside another named one (aten::linear's addmm) is
    not counted again."""
    def nested(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name in names:
                return True
            parent = parent.cpu_parent
        return False
    return sum(e.cpu_time_total for e in events if e.name in names and not nested(e)) / 1e3


def _start(engine, prompt: list[int], steps: int) -> None:
    engine.add_request("profile", Submission(prompt, SamplingParams(temperature=0, max_tokens=steps + 20,
                                                                     ignore_eos=True)))
    for _ in range(10):                      # prefill and warm-up steps
        engine.step()


def _stop(engine) -> None:
    engine.abort("profile")
    engine.step()


def clocked_step(llm: LLM, prompt: list[int], steps: int, rounds: int) -> dict:
    """Each step's wall time and, from the native loop's own clocks (verifier.quantized.cpu_loop.step_clock),
    its time in matmul calls and in attention, read for that same step; medians."""
    engine, cols = llm.engine, {"step_ms": [], "matmul_ms": [], "attention_ms": []}
    _start(engine, prompt, rounds * steps)
    step_clock(True)
    for _ in range(rounds * steps):
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        clock = step_clock(True)
        for col, v in zip(cols, (wall, clock["matmul"], clock["attention"])):
            cols[col].append(v * 1e3)
    step_clock(False)
    _stop(engine)
    share = [(w - m) / w for w, m in zip(cols["step_ms"], cols["matmul_ms"])]
    share_rest = [(w - m - a) / w for w, m, a in zip(cols["step_ms"], cols["matmul_ms"], cols["attention_ms"])]
    med = {k: statistics.median(v) for k, v in cols.items()}
    return {**med, "other_ms": med["step_ms"] - med["matmul_ms"], "other_share": statistics.median(share),
            "rest_share": statistics.median(share_rest), "by": "native clocks"}


def profiled_step(llm: LLM, prompt: list[int], steps: int, rounds: int, show_ops: bool) -> dict:
    """Rounds of `steps` timed steps then `steps` profiled ones; medians over all of them."""
    engine = llm.engine
    _start(engine, prompt, 2 * rounds * steps)
    walls, matmuls, attention = [], [], []
    for _ in range(rounds):
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        matmuls.append(_outermost_ms(prof.events(), MATMUL_OPS) / steps)
        attention.append(_outermost_ms(prof.events(), ATTENTION_OPS) / steps)
    _stop(engine)
    if show_ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    wall, matmul, att = statistics.median(walls) * 1e3, statistics.median(matmuls), statistics.median(attention)
    return {"step_ms": wall, "matmul_ms": matmul, "attention_ms": att, "other_ms": wall - matmul,
            "other_share": (wall - matmul) / wall, "rest_share": (wall - matmul - att) / wall, "by": "torch.profiler"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="auto,none")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", action="store_true", help="print the profiler's top operators")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"plain decode step at a {args.context}-token context, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} rounds of {args.steps} steps\n\n| quantization | step ms | matmul ms | "
          "everything else ms | of it, fused attention ms | everything else | everything else but the attention | "
          "measured by |\n|---|---|---|---|---|---|---|---|")
    for mode in args.quantization.split(","):
        llm = LLM(quantization=mode.strip(), max_num_seqs=1)
        prompt = long_prompt(llm, args.context)
        if getattr(llm.engine.target.runner, "native", None) is not None and not args.ops:   # the dense runner has none
            r = clocked_step(llm, prompt, args.steps, args.rounds)
        else:
            r = profiled_step(llm, prompt, args.steps, args.rounds, args.ops)
        print(f"| {mode} ({llm.engine.target.quantization}) | {r['step_ms']:.2f} | {r['matmul_ms']:.2f} | "
              f"{r['other_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_share']:.0%} | {r['rest_share']:.0%} | "
              f"{r['by']} |", flush=True)


if __name__ == "__main__":
    main()
