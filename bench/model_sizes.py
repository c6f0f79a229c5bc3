"""Tercel and llama.cpp side by side on GGUFs of real model sizes: load time, peak memory, disk
written, prefill and decode tok/s, one table.

    python -m bench.model_sizes --shape smollm2-1.7b --kinds Q4_0,Q4_K_M --out runs/shapes
    python -m bench.model_sizes --files runs/shapes/smollm2-1.7b-Q4_0.gguf,my-model-Q4_K_M.gguf

`--shape` writes random-weight files in a published model's shapes first (`bench.model_shapes`,
kept under `--out` for the next run); `--files` runs files that exist.

Each (file, engine, round) runs in a fresh process, so that its peak resident memory (the
kernel's high-water mark, `ru_maxrss`) is its own: the engine loads the file (Tercel's first
load under a new `TERCEL_CACHE` holding only this machine's compiled kernels, as a user's first
start with a model, then loads with that cache, as later starts), prefills a prompt of `--prefill-tokens` tokens (one token out: tok/s is prompt tokens
over the time to the first token), then decodes `--new-tokens` greedy tokens after a
`--prompt-tokens` prompt, EOS ignored (tok/s: new tokens over the whole call, prefill
included, as llama.cpp's users time it; and the decode rate after the first token). Engines
take `--threads` threads. Rounds alternate the engines; the table gives medians. The children are
`bench/size_child_tercel.py` and `bench/size_child_llamacpp.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from bench.llamacpp import INSTALL_HINT
from bench.model_shapes import SHAPES, has_llama_cpp, make
from verifier.cpu.cache import cache_root
from verifier.cpu.machine import machine_summary

FIELDS = ("load_s", "peak_gb", "disk_gb", "prefill_tok_s", "decode_tok_s", "decode_only_tok_s")


def _child(engine: str, path: str, args) -> dict:
    """One fresh process's figures (its disk writes: the growth of TERCEL_CACHE)."""
    cache = Path(os.environ.get("TERCEL_CACHE", ""))
    before = _tree_bytes(cache)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", f"bench.size_child_{engine}", "--file", path,
           "--threads", str(args.threads), "--prefill-tokens", str(args.prefill_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{engine} on {path} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "disk_gb": (_tree_bytes(cache) - before) / 1e9}


def _tree_bytes(root: Path) -> int:
    if not str(root) or not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@contextmanager
def fresh_cache() -> Iterator[Path]:
    """TERCEL_CACHE pointed at an empty folder holding this machine's compiled kernels (a first
    load that compiled them would time the compiler), set back afterwards."""
    built, saved = cache_root() / "cpu_kernels", os.environ.get("TERCEL_CACHE")
    with tempfile.TemporaryDirectory(prefix="tercel-cache-") as cache:
        if built.is_dir():
            shutil.copytree(built, Path(cache) / "cpu_kernels")
        os.environ["TERCEL_CACHE"] = cache
        try:
            yield Path(cache)
        finally:
            os.environ.pop("TERCEL_CACHE") if saved is None else os.environ.update(TERCEL_CACHE=saved)


def compare(files: list[str], args) -> list[tuple[str, str, dict]]:
    rows = []
    for path in files:
        with fresh_cache():
            runs: dict[str, list[dict]] = {}
            for r in range(args.rounds):
                for engine in args.engines.split(","):
                    label = engine if engine != "tercel" else ("tercel, first load" if r == 0 else "tercel")
                    runs.setdefault(label, []).append(_child(engine, path, args))
                    print(f"{Path(path).name} {label}: {runs[label][-1]}", file=sys.stderr)
            rows += [(Path(path).name, label, _medians(samples)) for label, samples in runs.items()]
    return rows


def _medians(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in (*FIELDS, "weights_gb") if k in samples[0]}


def read_bandwidth(threads: int, gb: float = 2.0) -> float:
    """GB/s of summing a buffer of `gb` on `threads` threads (the best of 5): how fast this
    machine streams memory, which bounds a decode step."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gb * 1e9) // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return gb / best


def table(rows: list[tuple[str, str, dict]], bandwidth: float) -> str:
    """One row per (file, engine); the decoder weights Tercel streams per decode step, times its
    decode rate, against the machine's read bandwidth."""
    lines = [f"machine read bandwidth: {bandwidth:.1f} GB/s", "",
             "| file | engine | load s | peak GB | disk written GB | prefill tok/s | decode tok/s (incl. prefill) "
             "| decode tok/s (after first) | decoder weights GB/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, engine, m in rows:
        stream = f"{m['weights_gb'] * m['decode_only_tok_s']:.3g}" if "weights_gb" in m else ""
        lines.append(f"| {name} | {engine} | {m['load_s']:.1f} | {m['peak_gb']:.2f} | {m.get('disk_gb', 0):.2f} | "
                     f"{m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {m['decode_only_tok_s']:.1f} | {stream} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", help="comma-separated GGUF files")
    ap.add_argument("--shape", action="append", default=[], help="write and run files of these shapes "
                    "(bench.model_shapes.SHAPES)")
    ap.add_argument("--kinds", default="Q4_0,Q4_K_M", help="with --shape: the quantizations written")
    ap.add_argument("--out", default="runs/shapes", help="with --shape: where the files are written")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="Tercel's first is its first load")
    ap.add_argument("--engines", default="tercel,llamacpp")
    ap.add_argument("--bandwidth-gb", type=float, default=2.0, help="the buffer the read bandwidth is timed on")
    args = ap.parse_args(argv)
    if "llamacpp" in args.engines.split(","):
        if not has_llama_cpp():
            ap.error(INSTALL_HINT + "; or --engines tercel")
    unknown = set(args.shape) - set(SHAPES)
    if unknown or not (args.files or args.shape):
        ap.error(f"--shape takes {', '.join(SHAPES)}" if unknown else "give --files or --shape")
    files = args.files.split(",") if args.files else []
    for name in args.shape:
        files += [str(p) for p in make(Path(args.out), name, args.kinds.split(","))]
    print(f"bench model_sizes: {machine_summary()}", file=sys.stderr)
    rows = compare(files, args)
    print(table(rows, read_bandwidth(args.threads, args.bandwidth_gb)))


if __name__ == "__main__":
    main()
