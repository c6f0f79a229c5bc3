"""Time to first token of a long prompt, per quantization, measured in one process.

    python -m bench.prefill --tokens 700 --quantization auto,none --repeats 5 --threads 2

The prompt is held-out text cut to `--tokens` tokens (chat template included). Each repeat
runs every quantization once, in rotated order, with the prefix cache off so that every
run prefills the whole prompt; the table gives medians and each mode's ratio to the first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.data import DATA
from spec import LLM, SamplingParams


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    text, ids = "", []
    for line in (DATA / "heldout" / "gsm8k_test.jsonl").read_text().splitlines():
        text += json.loads(line)["conversations"][0]["content"] + "\n"
        ids = llm.apply_chat_template([{"role": "user", "content": "Solve each problem.\n" + text}])
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def ttft(llm: LLM, ids: list[int]) -> float:
    start = time.perf_counter()
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--quantization", default="auto,none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.quantization.split(",")]
    llms = {m: LLM(quantization=m, enable_prefix_cache=False, max_num_seqs=1) for m in modes}
    ids = long_prompt(llms[modes[0]], args.tokens)
    for llm in llms.values():
        ttft(llm, ids)                               # warm-up: first-use kernel set-up
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            times[m].append(ttft(llms[m], ids))
    base = statistics.median(times[modes[0]])
    print(f"time to first token, {len(ids)}-token prompt, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}\n\n| quantization | TTFT ms | runs ms | vs {modes[0]} |\n|---|---|---|---|")
    for m in modes:
        med = statistics.median(times[m])
        print(f"| {m} ({llms[m].engine.target.quantization}) | {med * 1e3:.0f} | "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times[m])} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
