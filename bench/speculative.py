"""Speculative-core figures: the verify-time curve of the target forward, and drafter speed
against the plain engine (batch 1, greedy) on Spec-Bench tasks and MT-bench first turns.

    python -m bench.speculative --tasks summarization,rag --drafters ngram --limit 10 --repeats 3
    python -m bench.speculative --tasks mtbench,translation,summarization,qa,math_reasoning,rag \
        --drafters ngram,datastore:../shared/data/train --tree default --whole-tree-too --limit 5
    python -m bench.speculative --tasks agent,mtbench --drafters suffix,ngram --tree default \
        --quantization none --limit 10

`--tasks agent` adds the calculator-agent sessions of bench/agent.py, whose replies stop at
the end of their turn (the other sets run `--new-tokens` past it). `--until-eos` stops every
set's replies at their end, `--new-tokens` only a cap: Spec-Bench's own protocol with
`--new-tokens 1024`. Its footnote counts the plain replies that reached the cap (a small model
at T=0 often repeats itself up to it, which lookup drafters predict) and gives each drafter's
speedup over the replies that ended before it.

`--same-engine` adds each drafter's speedup over plain decoding on its own engine (the
drafter's requests run with speculation off, interleaved): two engines in one process can
differ in speed by several per cent whatever they run (docs/performance.md). Every engine runs
on all threads, the thread governor off: while one engine runs, the others' governors would
count its CPUs as a neighbour's and start their next run on one thread.

`--tree default` runs each drafter with its own default tree under the adaptive controller
(the offline API's default); `--whole-tree-too` adds each drafter verifying its whole tree
every step (`AdaptiveConfig(enabled=False)`), as "NAME (whole tree)".

tok/s is end to end (the prompt's prefill included: about half the time on summarization and
rag at 128 tokens); decode tok/s counts the tokens after the first over the time after it (what
speculation speeds up; vLLM's TPOT). Speedups are ratios of runs in the same process,
interleaved per repeat (plain, drafter, plain, drafter, ...), reported as medians. Before each
repeat every drafter forgets what it learned from earlier requests (suffix decoding's cached
outputs), so a repeat never drafts from its own prompts' earlier replies, and the prefix
cache is emptied, so every run prefills its prompts.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from bench.agent import agent_sessions
from bench.data import mtbench_first_turns, specbench_prompts
from bench.row_costs import cached_prefix, tree_batch
from drafters.config import SpecConfig
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from spec.threads import ThreadConfig
from verifier.cpu.machine import machine_summary


def verify_curve(llm: LLM, ctx: int = 512, sizes=(1, 4, 8, 16, 32, 64), repeats: int = 15) -> dict[int, float]:
    """Median ms of one target forward over a tree of n nodes after a ctx-token prefix
    (a binary-ish tree: node i's parent is (i - 1) // 2)."""
    target, out = llm.engine.target, {}
    with cached_prefix(llm, ctx, max(sizes)) as table:
        for n in sizes:
            batch = tree_batch(ctx, n, table, logits=True)
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                target.forward(batch)
                times.append(time.perf_counter() - t)
            out[n] = statistics.median(times) * 1e3
    return out


def run_set(llm: LLM, prompts: list[list[int]], new_tokens: int, ignore_eos: bool = True,
            speculate: bool = True) -> dict:
    """The prompts one at a time; `speculate=False` decodes them plainly on `llm`'s engine."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=ignore_eos)
    if llm.engine.drafter is not None:
        llm.engine.drafter.forget_history()
    llm.engine.reset_prefix_cache()     # every run prefills its prompts, as the first did
    t = time.perf_counter()
    outs = [llm.generate(p, params, speculate=speculate)[0] for p in prompts]
    wall = time.perf_counter() - t
    steps = sum(o.stats.verify_steps for o in outs)
    depth = [sum(col) for col in itertools.zip_longest(*[o.stats.accepted_per_depth for o in outs], fillvalue=0)]
    decode_s = sum(o.total_time - o.ttft for o in outs)
    ended = [o for o in outs if o.finish_reason != "length"]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tps": tokens / wall,
            "decode_tps": sum(len(o.token_ids) - 1 for o in outs) / decode_s,
            "tau": sum(o.stats.emitted_tokens for o in outs) / steps if steps else 1.0,
            "per_depth": [round(d / steps, 3) for d in depth] if steps else [],
            "draft_tokens_per_step": sum(o.stats.draft_tokens for o in outs) / steps if steps else 0.0,
            "tokens": tokens, "replies": len(outs),
            "capped": len(outs) - len(ended),
            "ended_tps": sum(len(o.token_ids) for o in ended) / sum(o.total_time for o in ended) if ended else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="summarization,rag")
    ap.add_argument("--drafters", default="ngram")
    ap.add_argument("--tree", default="gamma", choices=("gamma", "default"),
                    help="gamma: the chain or tree of --gamma and --topk; default: each drafter's own")
    ap.add_argument("--whole-tree-too", action="store_true", help="also each drafter without the adaptive controller")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--until-eos", action="store_true",
                    help="every task's replies stop at their end (Spec-Bench's protocol, --new-tokens the cap) "
                         "instead of running --new-tokens past it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-curve", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--same-engine", action="store_true",
                    help="each drafter against plain decoding on its own engine (its requests with speculation "
                         "off), as 'NAME (own plain)': two engines in one process can differ in speed")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpecConfig(num_speculative_tokens=args.gamma, topk=args.topk) if args.tree == "gamma" else None
    # Each engine on all threads: the thread governor would read the CPUs another engine of this
    # process used while it waited as a neighbour's, and start its next run on one thread.
    fixed = {"max_num_seqs": 1, "quantization": args.quantization, "thread_tuning": ThreadConfig(adaptive=False)}
    plain = LLM(**fixed)
    drafters = {}
    for d in args.drafters.split(","):
        drafters[d] = LLM(drafter=d, speculation=spec, **fixed)
        if args.whole_tree_too:
            drafters[f"{d} (whole tree)"] = LLM(drafter=d, speculation=spec, adaptive=AdaptiveConfig(enabled=False),
                                                **fixed)
    report = {"machine": machine_summary(), "quantization": args.quantization, "threads": torch.get_num_threads(),
              "gamma": args.gamma if spec else "default", "topk": args.topk if spec else "default",
              "until_eos": args.until_eos, "tasks": {}}
    if not args.no_curve:
        report["verify_ms"] = verify_curve(plain)
        print("verify forward (512-token prefix): " +
              ", ".join(f"{n} nodes {ms:.1f} ms" for n, ms in report["verify_ms"].items()))
    for task, conversations in prompt_sets(args.tasks.split(","), args.limit).items():
        prompts = [plain.apply_chat_template(c) for c in conversations]
        until_eos = task == "agent" or args.until_eos
        runs = {"plain": [], **{d: [] for d in drafters}}
        own = {d: [] for d in drafters} if args.same_engine else {}
        for _ in range(args.repeats):
            runs["plain"].append(run_set(plain, prompts, args.new_tokens, ignore_eos=not until_eos))
            for d, llm in drafters.items():
                if args.same_engine:
                    own[d].append(run_set(llm, prompts, args.new_tokens, not until_eos, speculate=False))
                runs[d].append(run_set(llm, prompts, args.new_tokens, ignore_eos=not until_eos))
        report["tasks"][task] = _summarise(runs)
        for d, plains in own.items():      # the drafter's runs over its own engine's plain ones
            report["tasks"][task][f"{d} (own plain)"] = _summarise({"plain": plains, d: runs[d]})[d]
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def prompt_sets(tasks: list[str], limit: int) -> dict[str, list[list[dict]]]:
    """Conversations per task: MT-bench first turns, the agent sessions, Spec-Bench tasks."""
    user = lambda texts: [[{"role": "user", "content": t}] for t in texts]  # noqa: E731
    sets = {"mtbench": user(mtbench_first_turns(limit))} if "mtbench" in tasks else {}
    if "agent" in tasks:
        sets["agent"] = agent_sessions(limit)
    rest = [t for t in tasks if t not in ("mtbench", "agent")]
    if rest:
        sets.update({task: user(texts) for task, texts in specbench_prompts(rest, limit).items()})
    return sets


def _summarise(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rs in runs.items():
        speedups, decode = _ratios(rs, runs["plain"], "tps"), _ratios(rs, runs["plain"], "decode_tps")
        ended = _ratios(rs, runs["plain"], "ended_tps")
        out[name] = {"tps": statistics.median(r["tps"] for r in rs), "speedup": statistics.median(speedups),
                     "speedup_range": [min(speedups), max(speedups)],
                     "decode_tps": statistics.median(r["decode_tps"] for r in rs),
                     "decode_speedup": statistics.median(decode), "decode_range": [min(decode), max(decode)],
                     "tau": rs[-1]["tau"],
                     "per_depth": rs[-1]["per_depth"], "draft_per_step": rs[-1]["draft_tokens_per_step"],
                     "tokens": rs[-1]["tokens"], "replies": rs[-1]["replies"], "capped": rs[-1]["capped"],
                     "ended_speedup": statistics.median(ended) if ended else None}
    return out


def _ratios(rs: list[dict], plains: list[dict], key: str) -> list[float]:
    """Each repeat's figure over the plain run's of the same repeat (repeats where either has none left out)."""
    return [r[key] / p[key] for r, p in zip(rs, plains) if r.get(key) and p.get(key)]


def _print(report: dict) -> None:
    print(f"{report['machine']}; quantization {report['quantization']}, gamma {report['gamma']}, "
          f"topk {report['topk']}")
    print("| task | drafter | tok/s | speedup (min-max) | decode tok/s | decode speedup (min-max) | tau | "
          "accepted per step by depth |")
    print("|---|---|---|---|---|---|---|---|")
    for task, rows in report["tasks"].items():
        for name, r in rows.items():
            lo, hi = r["speedup_range"]
            dlo, dhi = r["decode_range"]
            print(f"| {task} | {name} | {r['tps']:.1f} | {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                  f"{r['decode_tps']:.1f} | {r['decode_speedup']:.2f}x ({dlo:.2f}-{dhi:.2f}) | "
                  f"{r['tau']:.2f} | {r['per_depth']} |")
    if report.get("until_eos"):        # a reply at the cap ran on past where the model would stop
        print("\nplain replies at the --new-tokens cap, and each drafter's speedup over the replies that ended "
              "before it (end to end, the same prompts on both sides):")
        for task, rows in report["tasks"].items():
            ended = ", ".join(f"{n} {r['ended_speedup']:.2f}x" for n, r in rows.items()
                              if n != "plain" and r["ended_speedup"] is not None)
            print(f"- {task}: {rows['plain']['capped']} of {rows['plain']['replies']} at the cap "
                  f"({rows['plain']['tokens']} tokens in all); {ended or 'none ended'}")


if __name__ == "__main__":
    main()
