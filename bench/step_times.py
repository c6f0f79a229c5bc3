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

import torch

from bench.data import mtbench_first_turns
from spec import LLM, SamplingParams


def timed(llm: LLM) -> list[tuple[int, float, float]]:
    """(rows, step s, forward s) for each step `llm` runs from now on."""
    engine, target, steps, forward = llm.engine, llm.engine.target, [], {}
    step, run = engine.step, target.forward

    def timed_forward(batch, *args, **kwargs):
        t = time.perf_counter()
        out = run(batch, *args, **kwargs)
        forward["s"], forward["rows"] = time.perf_counter() - t, sum(len(s.token_ids) for s in batch.seqs)
        return out

    def timed_step():
        forward.clear()
        t = time.perf_counter()
        out = step()
        if forward:
            steps.append((forward["rows"], time.perf_counter() - t, forward["s"]))
        return out
    engine.step, target.forward = timed_step, timed_forward
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
    steps = {n: timed(llm) for n, llm in engines.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = mtbench_first_turns(args.limit)
    for _ in range(args.repeats):
        for llm in engines.values():
            for p in prompts:
                llm.chat([{"role": "user", "content": p}], params)
    for name, rec in steps.items():
        by = collections.defaultdict(list)
        for rows, step_s, fwd_s in rec:
            if rows <= args.max_rows:
                by[rows].append((step_s, fwd_s))
        print(f"{name}: {sum(len(v) for v in by.values())} steps")
        for rows in sorted(by):
            print(f"  rows {rows:2d}: {len(by[rows]):5d} steps, step {statistics.median(s for s, _ in by[rows]) * 1e3:6.2f} ms, "
                  f"forward {statistics.median(f for _, f in by[rows]) * 1e3:6.2f} ms")
    print(f"minor page faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt}")


if __name__ == "__main__":
    main()
