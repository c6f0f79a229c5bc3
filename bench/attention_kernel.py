"""The fused CPU attention (`verifier/cpu/csrc/decode_ops.c:attend`) of this checkout against a
git revision's, by context and tree size, interleaved in one process.

    python -m bench.attention_kernel --against HEAD~1 [--contexts 300,1500] [--rows 1,2,4,8]
    python -m bench.attention_kernel --against HEAD~1 --contexts 0,512 --prompt-rows 512
    TERCEL_CPU_ISA=avx2 python -m bench.attention_kernel --against HEAD~1     # the AVX2 build

30 layers of SmolLM2-135M attention (9 query heads on 3 KV heads of 64), one sequence whose
new rows are a binary tree (node i's parent is (i - 1) // 2) or, with `--prompt-rows`, a causal
prompt chunk of that many rows after the context, each layer its own random bf16
K/V cache in scattered 16-token blocks, on all threads. Every repeat times both libraries one
after the other; medians over repeats (the first two dropped). Both libraries are checked to
give the same bits before they are timed, unless `--numerics-change` says they may not.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tree.token_tree import TokenTree
from verifier.batch import SeqInput
from verifier.cpu import cpu_ops
from verifier.cpu.machine import machine_summary, march
from verifier.quantized.cpu_forward import row_plan

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
ROOT = Path(__file__).resolve().parent.parent
DECODE_SOURCES = 5     # cpu_ops.SOURCES every measured revision has (draft_layer.c came later)


def library_at(rev: str, into: Path) -> ctypes.CDLL:
    """The kernels' library built from `rev`'s sources (`git show`), loaded beside this one."""
    files = []
    for src in [*cpu_ops.SOURCES, *cpu_ops.HEADERS]:
        rel = src.relative_to(ROOT)
        out = into / rel.name
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True)
        if shown.returncode:        # a revision from before verifier/cpu/: the sources sat in verifier/csrc
            shown = subprocess.run(["git", "show", f"{rev}:verifier/csrc/{rel.name}"], cwd=ROOT,
                                   check=src in cpu_ops.SOURCES[:DECODE_SOURCES], capture_output=True)
            if shown.returncode:    # a file newer than `rev`: its sources do not include it or call it
                shown.stdout = b""
        out.write_bytes(shown.stdout)
        files.append(out)
    n = len(cpu_ops.SOURCES)
    path = cpu_ops.compile_library(files[:n], [*cpu_ops.FLAGS, "-lm"], ("CC", "cc", "gcc"), salt=rev,
                                   headers=files[n:])
    return cpu_ops._load(path, strict=False)


class Case:
    """One sequence at `ctx` cached tokens verifying an n-node binary tree, over LAYERS caches."""

    def __init__(self, ctx: int, n: int, gen: torch.Generator, prompt: bool = False):
        blocks = -(-(ctx + n) // BLOCK)
        table = torch.randperm(blocks, generator=gen).tolist()
        self.caches = [[torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
                        for _ in range(2)] for _ in range(LAYERS)]
        tree = TokenTree(tokens=list(range(100, 100 + n)), parents=[-1] + [(i - 1) // 2 for i in range(1, n)])
        seq = (SeqInput(list(tree.tokens), ctx, table) if prompt else
               SeqInput(list(tree.tokens), ctx, table, mask=tree.ancestor_mask() if n > 1 else None,
                        logits_indices=list(range(n))))
        self.plan = row_plan([seq], BLOCK, HEADS // KV_HEADS, prompt=prompt)
        self.q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
        none = torch.zeros(1, 1)                     # attend reads no rope table
        self.heads = cpu_ops.heads(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, none, none)
        self.heads.parallel_from = 0

    def run(self, lib: ctypes.CDLL, out: torch.Tensor) -> None:
        for k, v in self.caches:
            lib.attend(ctypes.byref(self.heads), ctypes.byref(self.plan), self.q.data_ptr(), k.data_ptr(),
                       v.data_ptr(), out.data_ptr())


def time_case(case: Case, libs: dict[str, ctypes.CDLL], repeats: int, same_bits: bool = True) -> dict[str, float]:
    outs = {name: torch.empty(case.q.shape[0], HEADS * HEAD_DIM, dtype=torch.bfloat16) for name in libs}
    ms: dict[str, list[float]] = {name: [] for name in libs}
    for i in range(repeats + 2):
        for name, lib in libs.items():
            start = time.perf_counter()
            case.run(lib, outs[name])
            if i >= 2:
                ms[name].append((time.perf_counter() - start) * 1e3)
    first, *rest = outs.values()
    if same_bits and not all(torch.equal(first, o) for o in rest):
        raise SystemExit("the two kernels give different bits (--numerics-change times them anyway)")
    return {name: statistics.median(t) for name, t in ms.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="a git revision whose kernel to time beside this checkout's")
    ap.add_argument("--contexts", default="300,1500")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--prompt-rows", default="", help="causal prompt chunks of these many rows instead of trees")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics-change", action="store_true",
                    help="time kernels whose outputs differ (a change of arithmetic, not only of speed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit("the fused CPU kernels are not built on this machine (no C compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.against: library_at(args.against, Path(tmp)), "this": cpu_ops._library()}
    print(f"attention_kernel: {machine_summary()}, -march={march()}, "
          f"{args.repeats} repeats, ms per {LAYERS} layers")
    prompt = bool(args.prompt_rows)
    print(f"\n| context | {'prompt rows' if prompt else 'rows'} | {args.against} | this | ratio |\n|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for ctx in map(int, args.contexts.split(",")):
        for n in map(int, (args.prompt_rows or args.rows).split(",")):
            t = time_case(Case(ctx, n, gen, prompt), libs, args.repeats, not args.numerics_change)
            print(f"| {ctx} | {n} | {t[args.against]:.2f} | {t['this']:.2f} | {t['this'] / t[args.against]:.2f} |")


if __name__ == "__main__":
    main()
