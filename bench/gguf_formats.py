"""Decode speed per GGUF block format: Tercel and llama.cpp on the same files, interleaved.

    python -m bench.gguf_formats --files smollm2-135m-instruct,PATH/smollm2-Q4_K_M.gguf,PATH/smollm2-Q6_K.gguf \\
        --limit 5 --max-tokens 128 --repeats 3

For each file: Tercel plain (`quantization="auto"`: int4 for the Q4_1 default, `gguf` for K-quant
files), Tercel with `--drafter` (the server's default, suffix decoding, adaptive; `none` leaves it
out), and llama.cpp
(llama-cpp-python, an optional extra) with the same threads. Each round runs every (file, engine)
pair on the same MT-bench first turns, chat template applied, greedy, `--max-tokens` each
(ignoring EOS, so every engine decodes the same number of tokens; the drafter forgets earlier
rounds' replies), in an order rotated per round
so a drift of the machine falls on all; the figure is the median tok/s over rounds (prompt time
included). Ratios: against Tercel plain on the first file, and against llama.cpp on the same file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

from bench.data import mtbench_first_turns
from bench.llamacpp import LlamaCppGenerator, check_llamacpp
from spec import LLM, SamplingParams
from spec.threads import ThreadConfig
from verifier.cpu.cpus import cpu_budget
from verifier.cpu.machine import machine_summary
from verifier.model.loader import DEFAULT_MODEL, resolve_model_dir
from verifier.model.tokenizer import Tokenizer


@dataclass
class Cell:
    file: str
    engine: str
    tok_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)


class Tercel:
    def __init__(self, model: str, drafter: str | None, threads: int | None, max_tokens: int):
        # the governor off: another engine of this process running would look like a neighbour
        self.llm = LLM(model, drafter=drafter, num_threads=threads, thread_tuning=ThreadConfig(adaptive=False))
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.quantization = self.llm.engine.target.quantization

    def run(self, prompts: list[str]) -> float:
        if self.llm.engine.drafter is not None:
            self.llm.engine.drafter.forget_history()      # no drafting from its own earlier replies
        self.llm.engine.reset_prefix_cache()              # every repeat prefills its prompts
        start = time.perf_counter()
        outs = [self.llm.chat([[{"role": "user", "content": p}]], self.params)[0] for p in prompts]   # batch 1
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


class LlamaCpp:
    def __init__(self, model: str, threads: int, max_tokens: int):
        check_llamacpp(model)
        self.tokenizer = Tokenizer(resolve_model_dir(model))          # the same chat template
        self.gen = LlamaCppGenerator(model, max_tokens, True, threads, self.tokenizer)

    def run(self, prompts: list[str]) -> float:
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            tokens += len(self.gen.generate(ids, 0.0, 0).token_ids)
        return tokens / (time.perf_counter() - start)


def engines(args, files: list[str]) -> dict[tuple[str, str], object]:
    threads = args.threads or cpu_budget().threads
    out = {}
    for f in files:
        plain = Tercel(f, None, args.threads, args.max_tokens)
        out[(f, f"tercel {plain.quantization}")] = plain
        if args.drafter != "none":
            out[(f, f"tercel {plain.quantization} + {args.drafter}")] = Tercel(f, args.drafter, args.threads,
                                                                             args.max_tokens)
        if not args.no_llamacpp:
            out[(f, "llama.cpp")] = LlamaCpp(f, threads, args.max_tokens)
    return out


def measure(runners: dict, prompts: list[str], repeats: int) -> list[Cell]:
    cells = {key: Cell(*key) for key in runners}
    keys = list(runners)
    for key in keys:                        # warm-up: kernels built and timed, caches filled
        runners[key].run(prompts[:1])
    for r in range(repeats):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            cells[key].tok_s.append(runners[key].run(prompts))
    return list(cells.values())


def report(cells: list[Cell]) -> str:
    base = cells[0].median
    llama = {c.file: c.median for c in cells if c.engine == "llama.cpp"}
    lines = ["| file | engine | tok/s (min-max) | vs first plain | vs llama.cpp, same file |", "|---|---|---|---|---|"]
    for c in cells:
        vs_llama = f"{c.median / llama[c.file]:.2f}x" if c.file in llama and c.engine != "llama.cpp" else ""
        lines.append(f"| {c.file.rsplit('/', 1)[-1]} | {c.engine} | {c.median:.1f} ({min(c.tok_s):.1f}-{max(c.tok_s):.1f})"
                     f" | {c.median / base:.2f}x | {vs_llama} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default=DEFAULT_MODEL, help="comma-separated models (GGUF files or aliases)")
    p.add_argument("--drafter", default="suffix", help="the drafter beside plain decoding ('none': plain only)")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = mtbench_first_turns(args.limit)
    cells = measure(engines(args, args.files.split(",")), prompts, args.repeats)
    print(f"{machine_summary()}; {len(prompts)} MT-bench prompts x {args.max_tokens} tokens, {args.repeats} rounds")
    print(report(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.__dict__ for c in cells], f, indent=1)


if __name__ == "__main__":
    main()
