"""`tercel bench structured`: JSON extraction under grammar constraints, with and without
jump-forward and speculation.

    tercel bench structured --drafter ngram,datastore:../shared/data/train --repeats 3 --threads 2

The prompts are bench/data/structured_tasks.jsonl: a short text and the JSON Schema to
extract into (written for this bench). Every configuration runs every prompt at T=0,
batch 1, on an engine of its own, the repeats interleaved (configuration by configuration
within a repeat); tokens/s is output tokens over wall time, prefill included, as
`tercel bench speed` counts it, summed over the prompts; medians over repeats. Decode tok/s
leaves the prefill out: output tokens after the first over the time after the first. Each engine
compiles every task's schema before the first repeat (xgrammar's compile is cached per
schema, as in a server that has seen it before).

    plain          constrained decoding, one token per step (no jump-forward, no drafter)
    plain+jf       jump-forward: the tokens the grammar forces verified as one chain
    DRAFTER+jf     each drafter's trees (pruned to the grammar), and jump-forward

Forced share: output tokens that came from jump-forward chains. Parse rate: outputs that
parse as JSON and validate against their schema (jsonschema); it must be 100%.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.cli_args import split_names
from spec import LLM, SamplingParams, StructuredOutputs
from verifier.cpu.machine import machine_summary
from verifier.model.loader import DEFAULT_MODEL

TASKS = Path(__file__).parent / "data" / "structured_tasks.jsonl"
PROMPT = ("Extract the information in the text below as a JSON object with the fields {fields}.\n\n"
          "Text: {text}")


@dataclass(frozen=True)
class StructuredTask:
    id: str
    schema: dict
    text: str

    def messages(self) -> list[dict]:
        fields = ", ".join(self.schema["properties"])
        return [{"role": "user", "content": PROMPT.format(fields=fields, text=self.text)}]


@dataclass(frozen=True)
class Config:
    name: str
    drafter: str | None
    jump_forward: bool


def load_tasks(limit: int | None = None) -> list[StructuredTask]:
    rows = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    return [StructuredTask(r["id"], r["schema"], r["text"]) for r in rows][:limit]


def configs(drafters: list[str]) -> list[Config]:
    return [Config("plain", None, False), Config("plain+jf", None, True),
            *(Config(f"{d.partition(':')[0]}+jf", d, True) for d in drafters)]


def run_config(llm, tasks: list[StructuredTask], max_tokens: int) -> dict:
    """One pass over the tasks: tokens, seconds, forced tokens, parses, speculation counters."""
    import jsonschema  # lazy: tercel[bench]'s; without it `tercel bench structured` exits 2 naming the extra
    llm.engine.reset_prefix_cache()
    tokens = forced = parsed = steps = accepted = 0
    seconds = decode_seconds = 0.0
    outputs = []
    for task in tasks:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=StructuredOutputs(json=task.schema))
        ids = llm.apply_chat_template(task.messages())
        start = time.perf_counter()
        out = llm.generate(ids, params)[0]
        seconds += time.perf_counter() - start
        decode_seconds += out.total_time - out.ttft      # after the first token: no prefill
        tokens += len(out.token_ids)
        forced += out.stats.forced_tokens
        steps += out.stats.verify_steps
        accepted += out.stats.accepted_tokens
        outputs.append(out.token_ids)
        try:
            jsonschema.validate(json.loads(out.text), task.schema)
            parsed += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "forced": forced, "parsed": parsed,
            "decode_tok_s": (tokens - len(tasks)) / decode_seconds,
            "prompts": len(tasks), "verify_steps": steps, "accepted": accepted, "outputs": outputs}


def run_bench(model: str, drafters: list[str], tasks: list[StructuredTask], repeats: int, max_tokens: int,
              quantization: str = "auto") -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    engines = {c.name: LLM(model, drafter=c.drafter, jump_forward=c.jump_forward, max_num_seqs=1,
                           quantization=quantization) for c in configs(drafters)}
    for llm in engines.values():     # compiled once per schema and cached, as a server's would be
        for task in tasks:
            llm.engine.grammars.compile(StructuredOutputs(json=task.schema))
    for r in range(repeats):
        for name, llm in engines.items():
            runs.setdefault(name, []).append(run_config(llm, tasks, max_tokens))
            print(f"repeat {r + 1}/{repeats} {name}: {runs[name][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    for llm in engines.values():
        llm.engine.check_integrity()
    return runs


def table(runs: dict[str, list[dict]]) -> str:
    base = statistics.median(r["tok_s"] for r in runs["plain"])
    decode_base = statistics.median(r["decode_tok_s"] for r in runs["plain"])
    reference = runs["plain"][0]["outputs"]
    lines = ["| configuration | tok/s (median) | range | vs plain | decode tok/s | vs plain | forced share "
             "| accepted draft tokens / step | parse rate | same tokens as plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        med = statistics.median(r["tok_s"] for r in rs)
        decode = statistics.median(r["decode_tok_s"] for r in rs)
        last = rs[-1]
        per_step = f"{last['accepted'] / last['verify_steps']:.2f}" if last["verify_steps"] else "-"
        same = all(r["outputs"] == reference for r in rs)
        lines.append(f"| {name} | {med:.1f} | {min(r['tok_s'] for r in rs):.1f}-{max(r['tok_s'] for r in rs):.1f} "
                     f"| {med / base:.2f}x | {decode:.1f} | {decode / decode_base:.2f}x | {last['forced'] / last['tokens']:.1%} | {per_step} "
                     f"| {last['parsed']}/{last['prompts']} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def run_structured_bench(args) -> int:
    drafters = [d for d in split_names(args.drafter) or [] if d not in ("none", "off")]
    tasks = load_tasks(args.limit)
    repeats = args.repeats or 3
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    print(f"bench structured: {len(tasks)} prompt(s), {repeats} repeat(s), up to {args.max_tokens} tokens, "
          f"{machine_summary()}", file=sys.stderr)
    runs = run_bench(args.model or DEFAULT_MODEL, drafters, tasks, repeats, args.max_tokens,
                     args.quantization.split(",")[0])
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({k: [{f: v for f, v in r.items() if f != "outputs"} for r in rs]
                                               for k, rs in runs.items()}, indent=1))
    return 0
