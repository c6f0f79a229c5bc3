"""EAGLE-3 figures: batch 1, MT-bench first turns, the plain engine and the EAGLE-3 drafter in
the same run (each prompt plain, then speculative), as many prompts as fit the time budget.

    python -m bench.eagle --prompts 80 --new-tokens 256 --minutes 20 --temperatures 0,0.7

Reports per temperature: tokens/s of both and their ratio (total tokens over total time,
and the median of per-prompt ratios), mean accepted length per verify step (bonus token
included), acceptance by tree depth, and the split of a speculative step into draft,
verify and accept time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.data import mtbench_first_turns
from drafters.config import SpecConfig
from spec import LLM, SamplingParams
from spec.threads import ThreadConfig


def run_prompt(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, float, object]:
    t = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    return len(out.token_ids), time.perf_counter() - t, out.stats


def bench_temperature(plain: LLM, speculative: LLM, prompts: list[list[int]], new_tokens: int,
                      temperature: float, seconds: float) -> dict:
    start = speculative.engine.stats().timing         # this temperature's steps only: the difference
    rows, deadline = [], time.perf_counter() + seconds
    for i, p in enumerate(prompts):
        if time.perf_counter() > deadline:
            break
        params = SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=i if temperature else None)
        n0, t0, _ = run_prompt(plain, p, params)
        n1, t1, st = run_prompt(speculative, p, params)
        rows.append((n0, t0, n1, t1, st))
    steps = sum(r[4].verify_steps for r in rows)
    depth = max((len(r[4].accepted_per_depth) for r in rows), default=0)
    per_depth = [sum(r[4].accepted_per_depth[d] for r in rows if d < len(r[4].accepted_per_depth)) / max(1, steps)
                 for d in range(depth)]
    timing = speculative.engine.stats().timing - start
    plain_tps = sum(r[0] for r in rows) / sum(r[1] for r in rows)
    spec_tps = sum(r[2] for r in rows) / sum(r[3] for r in rows)
    return {
        "temperature": temperature, "prompts": len(rows),
        "plain_tps": round(plain_tps, 2), "eagle_tps": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 3),
        "speedup_median_per_prompt": round(statistics.median((r[2] / r[3]) / (r[0] / r[1]) for r in rows), 3),
        "mean_accepted_length": round(sum(r[4].emitted_tokens for r in rows) / max(1, steps), 3),
        "draft_nodes_per_step": round(sum(r[4].draft_tokens for r in rows) / max(1, steps), 2),
        "accepted_by_depth": [round(x, 3) for x in per_depth],
        "ms_per_step": {k: round(1e3 * getattr(timing, f"{k}_seconds") / max(1, timing.steps), 2)
                        for k in ("draft", "verify", "accept")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=20.0, help="time budget per temperature")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--depth", type=int, default=None, help="tree depth (default: the drafter's)")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec_cfg = None
    if args.depth or args.topk or args.budget:
        spec_cfg = SpecConfig(num_speculative_tokens=args.depth or 6, topk=args.topk or 1, budget=args.budget)
    fixed = ThreadConfig(adaptive=False)   # the governor would take the other engine for a neighbour
    plain = LLM(max_num_seqs=1, thread_tuning=fixed)
    speculative = LLM(max_num_seqs=1, drafter=args.drafter, thread_tuning=fixed,
                      **({"speculation": spec_cfg} if spec_cfg else {}))
    prompts = [plain.apply_chat_template([{"role": "user", "content": t}])
               for t in mtbench_first_turns(args.prompts)]
    # Warm both engines once (first-call allocations are not what we measure).
    for llm in (plain, speculative):
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8))
    sc = speculative.engine.spec_config
    report = {"threads": torch.get_num_threads(), "drafter": args.drafter, "new_tokens": args.new_tokens,
              "tree": {"depth": sc.num_speculative_tokens, "topk": sc.topk, "budget": sc.max_nodes},
              "runs": []}
    for temp in (float(t) for t in args.temperatures.split(",")):
        r = bench_temperature(plain, speculative, prompts, args.new_tokens, temp, args.minutes * 60)
        report["runs"].append(r)
        print(json.dumps(r), flush=True)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _print(report: dict) -> None:
    t = report["tree"]
    print(f"\n{report['drafter']}, tree depth {t['depth']} top-k {t['topk']} budget {t['budget']}, "
          f"{report['threads']} threads, {report['new_tokens']} new tokens, batch 1")
    print("| T | prompts | plain tok/s | EAGLE tok/s | speedup (per-prompt median) | mean accepted length | "
          "accepted by depth | draft / verify / accept ms per step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        ms = r["ms_per_step"]
        print(f"| {r['temperature']} | {r['prompts']} | {r['plain_tps']} | {r['eagle_tps']} | "
              f"{r['speedup']}x ({r['speedup_median_per_prompt']}x) | {r['mean_accepted_length']} | "
              f"{r['accepted_by_depth']} | {ms['draft']} / {ms['verify']} / {ms['accept']} |")


if __name__ == "__main__":
    main()
