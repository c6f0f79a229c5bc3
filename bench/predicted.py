"""Code edits with and without a prediction (OpenAI's Predicted Outputs).

    python -m bench.predicted --repeats 3 --max-tokens 256 [--drafter ngram] [--gamma 8] [--threads 2]

Each request hands the model one small piece of this repository's source (a function, read
with `inspect` at run time) and asks for one small change: rename a variable, add a docstring
line. Its prediction is the file as the reply would hold it, a ```python block, as an editor
sends the file being edited. Every request runs at T=0, batch 1, on one engine, with and without
its prediction; the repeats are interleaved (request by request, the two modes alternating
which goes first), and the prefix cache is dropped before every run, so neither mode reuses
the other's prefill. tok/s: output tokens over wall time, prefill included; medians over the
repeats. The two modes must give the same tokens (the prediction is drafted, so it changes
the speed only); the last column says whether they did.
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import torch

from drafters.config import SpecConfig
from spec import LLM, SamplingParams
from verifier.cpu.machine import cpu_flags, machine_summary
from verifier.model.loader import DEFAULT_MODEL

PROMPT = ("Here is a Python file:\n\n```python\n{code}```\n\n{change} Reply with the whole file in one "
          "```python block and nothing else.")


@dataclass(frozen=True)
class EditTask:
    name: str
    source: str          # "module:qualname" of the code handed over
    change: str          # the instruction
    needs: str           # text the code must hold for the instruction to make sense

    def code(self) -> str:
        module, _, qualname = self.source.partition(":")
        obj = import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        code = textwrap.dedent(inspect.getsource(obj))
        if self.needs not in code:
            raise ValueError(f"{self.source} no longer holds {self.needs!r}: update the task {self.name!r}")
        return code

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": PROMPT.format(code=self.code(), change=self.change)}]

    def prediction(self) -> str:
        return f"```python\n{self.code()}```"


TASKS = (
    EditTask("merge_trees", "tree.builders:merge_trees", "Rename the variable `index` to `seen`.", "index"),
    EditTask("residual", "spec.rejection:_residual", "Rename the variable `fallback` to `backup`.", "fallback"),
    EditTask("common_prefix", "drafters.prediction:_common_prefix",
             "Add a docstring saying that it returns the length of the common prefix.", "def _common_prefix"),
    EditTask("ngram_update", "drafters.ngram:NgramIndex.update", "Rename the parameter `tokens` to `ids`.", "tokens"),
    EditTask("resolve_speculation", "serving.protocol:resolve_speculation",
             "Rename the parameter `field` to `asked`.", "field"),
)


def run_once(llm, task: EditTask, predicted: bool, max_tokens: int) -> dict:
    """One request from a cold prefix cache: its tokens, seconds and prediction counts."""
    llm.engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    out = llm.chat(task.messages(), params, predictions=task.prediction() if predicted else None)[0]
    seconds = time.perf_counter() - start
    return {"tokens": len(out.token_ids), "seconds": seconds, "tok_s": len(out.token_ids) / seconds,
            "accepted": out.stats.prediction_accepted, "rejected": out.stats.prediction_rejected,
            "ids": out.token_ids}


def run_bench(llm, tasks: list[EditTask], repeats: int, max_tokens: int) -> dict[str, dict[str, list[dict]]]:
    """runs[task][mode]: one record per repeat, modes "plain" and "predicted"."""
    runs: dict[str, dict[str, list[dict]]] = {t.name: {"plain": [], "predicted": []} for t in tasks}
    for r in range(repeats):
        for task in tasks:
            for predicted in ((False, True) if r % 2 == 0 else (True, False)):
                mode = "predicted" if predicted else "plain"
                runs[task.name][mode].append(run_once(llm, task, predicted, max_tokens))
                print(f"repeat {r + 1}/{repeats} {task.name} {mode}: "
                      f"{runs[task.name][mode][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    llm.engine.check_integrity()
    return runs


def table(runs: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| edit | output tokens | tok/s plain (median) | tok/s predicted (median) | speedup "
             "| prediction tokens accepted / rejected | same tokens |", "|---|---|---|---|---|---|---|"]
    for name, modes in runs.items():
        plain, pred = (statistics.median(r["tok_s"] for r in modes[m]) for m in ("plain", "predicted"))
        last = modes["predicted"][-1]
        same = all(r["ids"] == modes["plain"][0]["ids"] for m in modes.values() for r in m)
        lines.append(f"| {name} | {last['tokens']} | {plain:.1f} | {pred:.1f} | {pred / plain:.2f}x "
                     f"| {last['accepted']} / {last['rejected']} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", default=None, help="the server's drafter beside the prediction (default: none)")
    ap.add_argument("--gamma", type=int, default=None, help="the prediction chain's depth (default: the engine's)")
    ap.add_argument("--limit", type=int, default=None, help=f"the first N of the {len(TASKS)} edits")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the runs here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    spec = SpecConfig(num_speculative_tokens=args.gamma) if args.gamma else None
    llm = LLM(args.model, drafter=args.drafter if args.drafter not in (None, "none") else None, speculation=spec,
              max_num_seqs=1, num_threads=args.threads)
    tasks = list(TASKS[:args.limit])
    print(f"bench predicted: {len(tasks)} edit(s), {args.repeats} repeat(s), up to {args.max_tokens} tokens, "
          f"drafter {args.drafter or 'none'}, chain depth {llm.engine.spec_config.num_speculative_tokens}")
    print(f"machine: {machine_summary()}; torch threads {torch.get_num_threads()}")
    print(f"cpu flags (/proc/cpuinfo): {' '.join(f for f in cpu_flags() if f.startswith(('avx', 'fma', 'amx')))}")
    runs = run_bench(llm, tasks, args.repeats, args.max_tokens)
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
