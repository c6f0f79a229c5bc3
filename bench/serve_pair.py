"""`make serve`'s drafter against `--drafter none`, server against server.

    python -m bench.serve_pair --concurrency 1,4,16 --rounds 3
    TERCEL_CPU_ISA=avx2 python -m bench.serve_pair ...        # the AVX2 build
    python -m bench.serve_pair --configs default,noguard,none  # also the drafter without the batch guard
    python -m bench.serve_pair --workload agent --concurrency 1,4   # multi-turn agent sessions
    python -m bench.serve_pair --server-args=--fixed-threads  # more `tercel serve` flags, every server

Each round starts each server afresh (`tercel serve`, the order reversed in odd rounds) and runs
every concurrency level on prompts that process has not seen: the levels take disjoint slices of
the prompts (MT-bench's first turns, then Spec-Bench's), so suffix decoding's cross-request cache holds
only what the level's own earlier replies put there. Requests are streamed chat completions at
T=0 with EOS ignored (`--max-tokens` tokens each), a warm-up request first on a prompt no level
uses. The figure per level: tokens / wall time, and the ratio drafter / none per round; the
table gives medians over rounds (min-max of the ratios in brackets). `--configs` names the
servers: `default` (`make serve`'s), `noguard` (the same with `--no-batch-guard`), `none` (no
drafter, the baseline).

`--workload agent` sends the sessions of bench/agent_workload.py instead (calculator-agent loops
and code edits, each turn after the last reply; EOS ends a reply, `--max-tokens` caps it): a level
takes `--per-level` sessions (at least 2 per client), and a session's turns count as its requests.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys

from bench.agent_workload import agent_specs
from bench.data import load_datasets
from bench.serve_load import LoadConfig, check_server, launch_server, level_result, request_item, run_level
from verifier.cpu.machine import machine_key

# `tercel serve`'s arguments per configuration; "none" is the baseline every other is divided by
CONFIGS = {"default": [], "none": ["--drafter", "none"], "noguard": ["--no-batch-guard"]}


@contextlib.contextmanager
def server(args: list[str], port: int, threads: int | None):
    """`tercel serve` in its own process until the block ends; yields its URL."""
    proc, url = launch_server(["--log-level", "warning", *args] + (["--threads", str(threads)] if threads else []),
                              port)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def slices(prompts: list, levels: list[int], per_level: int) -> tuple[list, dict[int, list]]:
    """A warm-up prompt and disjoint prompt lists per level (`per_level` requests, at least 2 per client)."""
    out, i = {}, 1
    for c in levels:
        n = max(per_level, 2 * c)
        if i + n > len(prompts):
            raise ValueError(f"{len(prompts)} prompts are too few for levels {levels} at {per_level} each")
        out[c], i = prompts[i:i + n], i + n
    return prompts[0], out


# per workload: the requests' default max_tokens
WORKLOADS = {"chat": 128, "agent": 256}


def units(workload: str, n: int) -> list:
    """`n` prompts (message lists) or agent sessions, in the order levels slice them."""
    if workload == "agent":
        return agent_specs(n)
    return [p.messages() for p in load_datasets(["mtbench", "specbench"]).prompts][:n]


def work_items(cfg: LoadConfig, model: str, units: list) -> list:
    """What the workers send: a chat prompt runs to max_tokens (EOS ignored); a session as it ends."""
    items = [request_item(cfg, model, u, "on") for u in units]
    return [{**i, "ignore_eos": True} if isinstance(i, dict) else i for i in items]


async def run_server(url: str, warm, by_level: dict[int, list], max_tokens: int) -> dict[int, dict]:
    cfg = LoadConfig(url=url, max_tokens=max_tokens, modes=("on",))
    model = check_server(url)[0]
    bodies = lambda ps: work_items(cfg, model, ps)   # noqa: E731
    await run_level(cfg, bodies([warm]), 1)
    out = {}
    for c, ps in by_level.items():
        records, wall = await run_level(cfg, bodies(ps), c)
        out[c] = level_result("on", c, records, wall)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="default,none", help=f"servers compared, of {', '.join(CONFIGS)}")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="chat")
    ap.add_argument("--per-level", type=int, default=None,
                    help="prompts or sessions per level, at least 2 per client (default 16 prompts, 8 sessions)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default 128 chat, 256 agent)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-args", default="", help="more `tercel serve` flags for every server, e.g. '--fixed-threads'")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    names = args.configs.split(",")
    if "none" not in names or not set(names) <= set(CONFIGS):
        raise SystemExit(f"--configs takes none and others of {', '.join(CONFIGS)}, got {args.configs}")
    per_level = args.per_level or (8 if args.workload == "agent" else 16)
    max_tokens = args.max_tokens or WORKLOADS[args.workload]
    warm, by_level = slices(units(args.workload, 1 + sum(max(per_level, 2 * c) for c in levels)), levels, per_level)
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        got = {}
        for name in order:
            with server(CONFIGS[name] + shlex.split(args.server_args), args.port, args.threads) as url:
                got[name] = asyncio.run(run_server(url, warm, by_level, max_tokens))
            print(f"round {r + 1} {name}: " + ", ".join(f"{c} clients {got[name][c]['throughput_tok_s']:.1f} tok/s"
                                                         for c in levels), file=sys.stderr, flush=True)
        rounds.append(got)
    print(table(rounds, levels, [n for n in names if n != "none"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_key(), "isa": os.environ.get("TERCEL_CPU_ISA"), "threads": args.threads,
                       "workload": args.workload, "max_tokens": max_tokens,
                       "rounds": rounds}, f, indent=1)
    return 0


def table(rounds: list[dict], levels: list[int], others: list[str]) -> str:
    head = "| clients | none tok/s | " + " | ".join(f"{n} tok/s | {n} / none | τ ({n})" for n in others) + " | errors |"
    lines = [head, "|" + "---|" * (3 + 3 * len(others))]
    for c in levels:
        base = [r["none"][c]["throughput_tok_s"] for r in rounds]
        cells = [f"{c}", f"{statistics.median(base):.1f}"]
        for n in others:
            tps = [r[n][c]["throughput_tok_s"] for r in rounds]
            ratios = [t / b for t, b in zip(tps, base)]
            tau = [r[n][c]["mean_accepted_length"] or 1.0 for r in rounds]
            cells += [f"{statistics.median(tps):.1f}",
                      f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", f"{statistics.median(tau):.2f}"]
        cells.append(str(sum(r[n][c]["errors"] for r in rounds for n in r)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
