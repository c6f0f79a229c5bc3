"""Tercel's figures for `bench.model_sizes` (`python -m bench.size_child_tercel --file F`)."""
from __future__ import annotations

import json
import time

import torch

from bench.size_child import child_args, measure
from spec.llm import LLM
from verifier.sampling.sampling_params import SamplingParams


def figures(path: str, args) -> dict:
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    # no prefix cache: the decode prompt begins as the prefill one does, and llama.cpp is reset per call
    llm = LLM(model=path, num_threads=args.threads, drafter=None, enable_prefix_cache=False)
    load = time.perf_counter() - start

    def run(prompt: list[int], n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        return time.perf_counter() - t0, out.ttft
    return {**measure(load, run, args), "weights_gb": llm.engine.memory.weights / 1e9}


if __name__ == "__main__":
    a = child_args()
    print(json.dumps(figures(a.file, a)))
