"""One engine's figures for `bench.model_sizes`, in a process of its own (`python -m
bench.size_child_tercel` / `bench.size_child_llamacpp`): its peak resident memory is the
engine's alone, so this module and the llama.cpp child load no torch."""
from __future__ import annotations

import argparse
import resource


def child_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description="one engine's figures for bench.model_sizes")
    ap.add_argument("--file", required=True)
    for name, default in (("--threads", 2), ("--prefill-tokens", 512), ("--prompt-tokens", 40), ("--new-tokens", 32)):
        ap.add_argument(name, type=int, default=default)
    return ap.parse_args(argv)


def prompt_ids(n: int) -> list[int]:
    """n token ids of ordinary text (ids below the default tokenizer's 49,152, any model of it)."""
    return [(1000 + 7 * i) % 40000 + 100 for i in range(n)]


def measure(load: float, run, args) -> dict:
    run(prompt_ids(8), 2)                               # warm: first calls build kernels, fault pages in
    total, _ = run(prompt_ids(args.prefill_tokens), 1)
    prefill = args.prefill_tokens / total
    total, first = run(prompt_ids(args.prompt_tokens), args.new_tokens)
    return {"load_s": load, "prefill_tok_s": prefill, "decode_tok_s": args.new_tokens / total,
            "decode_only_tok_s": (args.new_tokens - 1) / (total - first),
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
