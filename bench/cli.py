"""`tercel bench`'s dispatch: runs the subcommand that bench/parser.py's arguments name."""
from __future__ import annotations

import sys

import torch

from bench.cli_engine import run_engine_bench
from bench.cli_model import run_model_bench
from bench.parser import BENCH_EXTRA
from bench.replay import run_replay_cli
from bench.structured import run_structured_bench


def run_bench(args) -> int:
    """ValueError propagates to `tercel`'s handler (message, exit code 2)."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.tensor_parallel_size != 1 and args.what not in ("accept", "grid", "speed"):
        # serve loads a running server (its own --tensor-parallel-size); kernels and quality time
        # the quantized CPU path, which is not sharded; structured holds several engines at once,
        # and a process has one tensor-parallel group
        raise ValueError(f"--tensor-parallel-size applies to bench accept, grid and speed, not {args.what}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.what == "serve":
            # lazy: serve_load imports httpx (tercel[bench]); without it this raises the ModuleNotFoundError below
            from bench.cli_serve import run_serve_bench_cli
            return run_serve_bench_cli(args)
        if args.what == "structured":
            return run_structured_bench(args)
        if args.what == "replay":
            return run_replay_cli(args)
        if args.what in ("kernels", "quality"):
            return run_model_bench(args)
        return run_engine_bench(args)
    except ModuleNotFoundError as e:
        if e.name not in BENCH_EXTRA:
            raise
        print(f"tercel bench {args.what} needs {e.name}: pip install 'tercel[bench]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = f"; finished runs are in {args.json}: rerun with --resume" if args.json else ""
        print(f"\ntercel bench: interrupted{kept}", file=sys.stderr)
        return 130
