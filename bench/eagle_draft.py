"""What drafting costs the EAGLE-3 head a step, per form of its layers (docs/eagle3.md).

    python -m bench.eagle_draft --forms bf16,int8-torch,int8 --prompts 2 --tokens 64
    python -m bench.eagle_draft --cold-layers          # one row of each projection after a cache sweep

Forms: "bf16" (oneDNN at any row count), "int8-torch" (int8 weights, the layer as torch ops),
"int8" (the layer in one C call, the drafter's choice where the int8 kernel is built). The
engine runs the int4 target, batch 1, greedy, whole trees (the cost model off); the head's
catch-up and tree levels are timed by wrapping them. Every form runs the same prompts in one
process, one after another.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import drafters.eagle3.drafter as eagle
from bench.speculative import prompt_sets
from drafters.eagle3.draft_layers import Int8DraftLinear
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from spec.threads import ThreadConfig
from verifier.cpu.machine import machine_summary
from verifier.model.linear import Linear

# The head's projections of the default model, one row each (q/k/v and gate/up stacked).
LAYER_SHAPES = {"fc": (576, 1728), "qkv": (960, 1152), "o": (576, 576), "gate_up": (3072, 576),
                "down": (576, 1536), "lm_head": (8192, 576)}


def _timed(obj, name: str, acc: dict, calls: collections.Counter):
    """Wrap obj.name to add its time to acc[name] and count its calls; returns the original."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            calls[name] += 1
    setattr(obj, name, wrapped)
    return fn


def drafting_ms(form: str, prompts: int, tokens: int) -> dict[str, float]:
    """ms a verify step for the catch-up, the tree levels and both, ms a call for the head's layer
    and its final norm and LM head, and τ, for one form."""
    real = eagle.draft_form
    eagle.draft_form = lambda device: form.split("-")[0]
    try:
        llm = LLM(drafter="eagle3", max_num_seqs=1, quantization="int4", thread_tuning=ThreadConfig(adaptive=False),
                  adaptive=AdaptiveConfig(enabled=False))
    finally:
        eagle.draft_form = real
    if form == "int8-torch":
        llm.engine.drafter.head.native = None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [llm.apply_chat_template(c) for c in prompt_sets(["mtbench"], prompts + 1)["mtbench"]]
    llm.generate(ids[0], params)                         # warm-up
    acc, calls, head = collections.defaultdict(float), collections.Counter(), llm.engine.drafter.head
    wrapped = [(cls, name, _timed(cls, name, acc, calls)) for cls, name in
               ((eagle.Eagle3Drafter, "_catch_up"), (eagle._Expander, "__call__"))]
    for name in ("layer", "draft_logits"):          # on the instance: deleted after, the class's again
        _timed(head, name, acc, calls)
    try:
        outs = [llm.generate(p, params)[0] for p in ids[1:]]
    finally:
        for cls, name, fn in wrapped:
            setattr(cls, name, fn)
        del head.layer, head.draft_logits
    steps = sum(o.stats.verify_steps for o in outs)
    catch, levels = acc["_catch_up"] * 1e3 / steps, acc["__call__"] * 1e3 / steps
    return {"catch_up": catch, "levels": levels, "drafting": catch + levels,
            "layer_call": acc["layer"] * 1e3 / calls["layer"], "lm_call": acc["draft_logits"] * 1e3 / calls["draft_logits"],
            "tau": sum(len(o.token_ids) for o in outs) / steps}


def cold_layers(repeats: int = 30) -> dict[str, dict[str, float]]:
    """ms for one row of each projection, bf16 on oneDNN against int8 on the q8 kernel, each call
    after a 64 MB sweep (as the target's forward evicts the head's weights between levels)."""
    sweep = torch.empty(16 * 2 ** 20)

    def cold(fn, x) -> float:
        times = []
        for _ in range(repeats):
            sweep.add_(1.0)
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3
    out = {}
    for name, (n, k) in LAYER_SHAPES.items():
        dense = Linear(k, n, bias=False)
        int8 = Int8DraftLinear(dense)
        dense = dense.to(torch.bfloat16)
        dense.bf16_any_rows = True
        x = torch.randn(1, k)
        with torch.inference_mode():
            out[name] = {"bf16": cold(dense, x.bfloat16()), "int8": cold(int8, x)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", default="bf16,int8-torch,int8")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-layers", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_summary())
    if args.cold_layers:
        rows = cold_layers()
        print("| projection | bf16 ms | int8 ms |\n|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['bf16']:.3f} | {r['int8']:.3f} |")
        print(f"| all | {sum(r['bf16'] for r in rows.values()):.3f} | {sum(r['int8'] for r in rows.values()):.3f} |")
        return
    print("| form | catch-up ms/step | tree levels ms/step | drafting ms/step | layer ms/call | "
          "norm + LM head ms/call | τ |\n|---|---|---|---|---|---|---|")
    for form in args.forms.split(","):
        r = drafting_ms(form, args.prompts, args.tokens)
        print(f"| {form} | {r['catch_up']:.2f} | {r['levels']:.2f} | {r['drafting']:.2f} | {r['layer_call']:.3f} | "
              f"{r['lm_call']:.3f} | {r['tau']:.2f} |")


if __name__ == "__main__":
    main()
