"""llama.cpp's figures for `bench.model_sizes` (`python -m bench.size_child_llamacpp --file F`;
the optional tercel[llamacpp] extra, checked by the parent before it starts this)."""
from __future__ import annotations

import json
import time

from llama_cpp import Llama

from bench.size_child import child_args, measure


def figures(path: str, args) -> dict:
    start = time.perf_counter()
    llm = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=4096,
                n_batch=512, verbose=False)
    load = time.perf_counter() - start

    def run(prompt: list[int], n: int) -> tuple[float, float]:
        llm.reset()
        t0, first, count = time.perf_counter(), None, 0
        for _ in llm.generate(prompt, reset=True, temp=0.0, top_k=1, repeat_penalty=1.0):
            first = first or time.perf_counter()
            count += 1
            if count >= n:
                break
        return time.perf_counter() - t0, first - t0
    return measure(load, run, args)


if __name__ == "__main__":
    a = child_args()
    print(json.dumps(figures(a.file, a)))
