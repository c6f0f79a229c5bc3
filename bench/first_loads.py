"""How long a GGUF takes to load in each state the Tercel cache can be in, each in a fresh process
timing `LLM(model=..., drafter=None)`:

    python -m bench.first_loads --files runs/shapes/smollm2-1.7b-Q4_0.gguf --rounds 2

- first: the machine's first load of these shapes (the cache holds only the compiled kernels:
  the kernels' timings, the thread check and the tokenizer's conversion all run);
- later: the same file again;
- new file: another file of these shapes and this tokenizer (the model's folder removed);
- new tokenizer: the tokenizers' folder removed too, so transformers converts it again.

`bench.model_sizes` runs loads beside prefill, decode and llama.cpp; this isolates the load.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys

from bench.model_sizes import fresh_cache
from verifier.cpu.machine import machine_summary

STATES = ("first", "later", "new file", "new tokenizer")
_CHILD = ("import sys, time, torch; torch.set_num_threads(int(sys.argv[2])); from spec import LLM; "
          "t = time.perf_counter(); LLM(model=sys.argv[1], drafter=None); print(time.perf_counter() - t)")


def _load_s(path: str, threads: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(threads)], env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"loading {path} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def one_round(path: str, threads: int) -> dict[str, float]:
    """Seconds per state, in STATES' order, under a cache of this round's own."""
    with fresh_cache() as cache:
        out = {"first": _load_s(path, threads), "later": _load_s(path, threads)}
        shutil.rmtree(cache / "models")
        out["new file"] = _load_s(path, threads)
        shutil.rmtree(cache / "models")
        shutil.rmtree(cache / "tokenizers")
        out["new tokenizer"] = _load_s(path, threads)
    return out


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| file | " + " | ".join(f"{s} (s)" for s in STATES) + " |", "|---" * (len(STATES) + 1) + "|"]
    for name, rounds in results.items():
        cells = [f"{statistics.median(r[s] for r in rounds):.2f} ({min(r[s] for r in rounds):.2f}-"
                 f"{max(r[s] for r in rounds):.2f})" for s in STATES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", required=True, help="comma-separated GGUF files")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"bench first_loads: {machine_summary()}", file=sys.stderr)
    results: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):                   # rounds alternate the files
        for path in args.files.split(","):
            results.setdefault(os.path.basename(path), []).append(one_round(path, args.threads))
            print(f"round {r + 1} {path}: {results[os.path.basename(path)][-1]}", file=sys.stderr)
    print(table(results))


if __name__ == "__main__":
    main()
