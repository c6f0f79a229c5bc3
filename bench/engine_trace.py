"""A step-by-step trace of the engine, for changes that must not change its behaviour (the engine's
rooms, issue 65): run it before and after, on the same machine, and compare the files byte by byte.

    python -m bench.engine_trace --out before.jsonl
    ... change the engine ...
    python -m bench.engine_trace --out after.jsonl && cmp before.jsonl after.jsonl

Four scenarios on the default model: int4 plain decoding, int4 with suffix decoding, the dense
model with its int4 self as a `small:` draft, and int4 + suffix with one request under a JSON
schema beside plain ones. Requests arrive over the first steps (continuous batching), prompts
are cut into chunks (a small token budget per step) and a pool too small for all of them forces
preemption. One JSON line per step: each request's new tokens and finish reason, the block table of
every running request, and every tree the drafter proposed. Every timing-driven choice is pinned:
speculation verifies whole trees, threads stay fixed, so the trace depends on the code and the
machine's kernels only (another CPU kind may round differently: compare on one machine).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.data import mtbench_first_turns
from spec import LLM, SamplingParams, Submission
from spec.adaptive import AdaptiveConfig
from spec.threads import ThreadConfig
from verifier.sampling.structured import StructuredOutputs

NEW_TOKENS = 40
ARRIVALS = (0, 0, 2, 5)                          # the step each prompt arrives at
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["answer", "score"]}


def scenarios() -> dict[str, dict]:
    """name -> LLM keyword arguments (beside the pinned ones)."""
    return {"int4 plain": dict(quantization="int4"),
            "int4 suffix": dict(quantization="int4", drafter="suffix"),
            "dense + int4 self-draft": dict(quantization="none", drafter="small:smollm2-135m-instruct"),
            "int4 suffix constrained": dict(quantization="int4", drafter="suffix", constrained=True)}


def trace(name: str, kw: dict, prompts: list[str], out) -> None:
    constrained = kw.pop("constrained", False)
    llm = LLM(**kw, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=24, block_size=16,
              adaptive=AdaptiveConfig(enabled=False), thread_tuning=ThreadConfig(adaptive=False))
    engine, proposed = llm.engine, []
    if engine.drafter is not None:
        propose = engine.drafter.propose

        def recording(views):
            props = propose(views)
            proposed.extend([v.seq_id, list(p.tree.tokens), list(p.tree.parents)] for v, p in zip(views, props))
            return props
        engine.drafter.propose = recording
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    step = 0
    while step <= max(ARRIVALS) or engine.has_unfinished:
        for i, at in enumerate(ARRIVALS):
            if at == step:
                schema = StructuredOutputs(json=SCHEMA) if constrained and i == 1 else None
                engine.add_request(f"r{i}", Submission(ids[i], SamplingParams(
                    temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, structured=schema)))
        outputs = engine.step()
        tables = {r.request_id: engine.blocks.block_table(r.seq_id) for r in engine.scheduler.running}
        out.write(json.dumps({"scenario": name, "step": step, "tables": tables, "trees": proposed,
                              "outputs": [[o.request_id, o.delta_token_ids, o.finish_reason] for o in outputs]}) + "\n")
        proposed.clear()
        step += 1
    engine.check_integrity()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = mtbench_first_turns(len(ARRIVALS))
    with open(args.out, "w") as out:
        for name, kw in scenarios().items():
            trace(name, kw, prompts, out)
            print(f"traced {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
