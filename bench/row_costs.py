"""What an extra verify row costs, part by part: one target forward over a tree of n nodes after
a `--context`-token prefix, timed by the wall clock and the native loop's own clocks.

    python -m bench.row_costs --context 512,1536 --rows 1,2,4,8 --threads 2
    TERCEL_CPU_ISA=avx2 python -m bench.row_costs --context 512 --rows 1,2,4,8 --threads 2

For each context and row count, medians of `--rounds` x `--calls` forwards, row counts
interleaved per round: the forward's wall time; its decoder matmuls; the LM head (the same
forward with and without logits, so its scan, top-k and rescoring); the fused attention with its
KV prefetch; and the rest (norms, RoPE, the KV write, the call's Python). "+ per row" is the
step from one row to the last count, divided by the rows added. `--attention-threads serial` or
`all` overrides the measured threshold from which attention runs on all threads
(`verifier/quantized/attention_tuning.py`), to see what that choice costs. Quantized (native
loop) targets only.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spec import LLM
from tree.token_tree import TokenTree
from verifier.batch import ForwardBatch, SeqInput
from verifier.cpu.machine import machine_summary
from verifier.quantized.attention_tuning import NEVER
from verifier.quantized.cpu_loop import step_clock

PARTS = ("forward", "matmul", "head", "attention", "rest")
THRESHOLDS = {"serial": NEVER, "all": 0}


@contextmanager
def cached_prefix(llm: LLM, ctx: int, room: int) -> Iterator[list[int]]:
    """The block table of a sequence of its own whose first ctx tokens are in the KV cache, with
    room for `room` more; its blocks go back to the pool after."""
    blocks, seq = llm.engine.blocks, 10**9
    blocks.allocate(seq, list(range(10, 10 + ctx + room)))
    table = blocks.block_table(seq)
    try:
        llm.engine.target.forward(ForwardBatch([SeqInput(list(range(10, 10 + ctx)), 0, table)]))
        yield table
    finally:
        blocks.free(seq)


def tree_batch(ctx: int, n: int, table: list[int], logits: bool) -> ForwardBatch:
    """A binary-ish tree of n nodes (node i's parent is (i - 1) // 2) after ctx cached tokens."""
    tree = TokenTree(tokens=list(range(100, 100 + n)), parents=[-1] + [(i - 1) // 2 for i in range(1, n)])
    return ForwardBatch([SeqInput(list(tree.tokens), ctx, table, positions=tree.positions(ctx),
                                  mask=tree.ancestor_mask(), logits_indices=list(range(n)) if logits else [])])


def timed(target, batch: ForwardBatch) -> tuple[float, dict[str, float]]:
    """One forward's wall seconds and the native clocks' seconds for it."""
    step_clock(True)
    start = time.perf_counter()
    target.forward(batch)
    wall = time.perf_counter() - start
    return wall, step_clock(False)


def costs(llm: LLM, ctx: int, rows: list[int], rounds: int, calls: int) -> dict[int, dict[str, float]]:
    """Milliseconds per part (PARTS) for each row count: medians over rounds x calls."""
    target = llm.engine.target
    samples: dict[int, dict[str, list[float]]] = {n: {p: [] for p in PARTS} for n in rows}
    with cached_prefix(llm, ctx, max(rows)) as table:
        for _ in range(rounds):
            for n in rows:
                with_head, without = tree_batch(ctx, n, table, True), tree_batch(ctx, n, table, False)
                for _ in range(calls):
                    wall, clock = timed(target, with_head)
                    bare, bare_clock = timed(target, without)
                    s = samples[n]
                    s["forward"].append(wall)
                    s["matmul"].append(bare_clock["matmul"])
                    s["head"].append(wall - bare)
                    s["attention"].append(clock["attention"])
                    s["rest"].append(bare - bare_clock["matmul"] - bare_clock["attention"])
    return {n: {p: statistics.median(v) * 1e3 for p, v in s.items()} for n, s in samples.items()}


def table(ctx: int, rows: list[int], ms: dict[int, dict[str, float]]) -> str:
    lines = [f"context {ctx}, ms\n", "| rows | " + " | ".join(PARTS) + " |", "|---" * (len(PARTS) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{ms[n][p]:.2f}" for p in PARTS) + " |" for n in rows]
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        per = {p: (ms[b][p] - ms[a][p]) / (b - a) for p in PARTS}
        share = per["forward"] / ms[a]["forward"]
        lines.append(f"| + per row | " + " | ".join(f"{per[p]:.2f}" for p in PARTS) + f" |  ({share:.0%} of {a} row)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF path or registry name (default: the default model)")
    ap.add_argument("--context", default="512")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention-threads", choices=("measured", *THRESHOLDS), default="measured")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(**({"model": args.model} if args.model else {}), max_num_seqs=1)
    runner = llm.engine.target.runner
    if getattr(runner, "native", None) is None:
        raise SystemExit("bench.row_costs times the native loop: a quantized target on the CPU")
    if args.attention_threads != "measured":
        runner.heads.parallel_from = THRESHOLDS[args.attention_threads]
    print(f"{machine_summary()}; attention on all threads from work {runner.heads.parallel_from} "
          f"(rows x keys x query heads)\n")
    rows = [int(r) for r in args.rows.split(",")]
    for ctx in (int(c) for c in args.context.split(",")):
        print(table(ctx, rows, costs(llm, ctx, rows, args.rounds, args.calls)) + "\n", flush=True)


if __name__ == "__main__":
    main()
