"""Engine step and target forward times by the rows a step verifies, for engines side by side in
one process (batch 1, greedy, MT-bench first turns), each engine's prompts run in turn per repeat.

    python -m bench.step_times --engines plain,suffix --limit 10 --repeats 2 --threads 2
    python -m bench.step_times --engines plain,plain@2 --limit 6 --repeats 1

"plain" is an engine without a drafter (names after "@" tell copies apart: plain@2); any other
name is a drafter. Steps with more than --max-rows rows (prompt chunks) are left out. Prints, per
engine and row count, the steps and their median step and forward milliseconds, and the minor
page faults of the whole process.
"""
from __future__ import annotations

import argparse
import collections
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from bench.data import mtbench_first_turns
from spec import LLM, SamplingParams


@dataclass(frozen=True)
class StepTime:
    """One engine step timed from outside: its forward's rows, whether a prompt chunk ran in it,
    the forward's seconds (its inputs built and run) and the whole step's."""
    rows: int
    prompt: bool
    forward_s: float
    step_s: float


def timed(engine) -> list[StepTime]:
    """A StepTime for each step `engine` runs from now on that ran a forward."""
    steps, last, step, forward = [], {}, engine.step, engine._forward

    def timed_forward(plans):
        t = time.perf_counter()
        out = forward(plans)
        if plans:
            last.update(rows=sum(p.num_rows for p in plans), prompt=any(p.is_prompt for p in plans),
                        s=time.perf_counter() - t)
        return out

    def timed_step():
        last.clear()
        t = time.perf_counter()
        out = step()
        if last:
            steps.append(StepTime(last["rows"], last["prompt"], last["s"], time.perf_counter() - t))
        return out
    engine.step, engine._forward = timed_step, timed_forward
    return steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="plain,suffix")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-rows", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.engines.split(",")
    engines = {n: LLM(drafter=None if n.split("@")[0] == "plain" else n.split("@")[0]) for n in names}
    steps = {n: timed(llm.engine) for n, llm in engines.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = mtbench_first_turns(args.limit)
    for _ in range(args.repeats):
        for llm in engines.values():
            for p in prompts:
                llm.chat([{"role": "user", "content": p}], params)
    for name, rec in steps.items():
        by = collections.defaultdict(list)
        for s in rec:
            if s.rows <= args.max_rows:
                by[s.rows].append((s.step_s, s.forward_s))
        print(f"{name}: {sum(len(v) for v in by.values())} steps")
        for rows in sorted(by):
            print(f"  rows {rows:2d}: {len(by[rows]):5d} steps, step {statistics.median(s for s, _ in by[rows]) * 1e3:6.2f} ms, "
                  f"forward {statistics.median(f for _, f in by[rows]) * 1e3:6.2f} ms")
    print(f"minor page faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt}")


if __name__ == "__main__":
    main()
