"""One forward of decode rows under LoRA adapters against the same rows on the base: where a
multi-LoRA batch's time goes (bench.lora_batch measures whole batches).

    python -m bench.lora_step --adapters 4 --rows 8 --calls 30 --repeats 3 --train-steps 30
    python -m bench.lora_step ... --products      # the products alone, hot in the caches

The adapters are bench.lora_batch's (the same flags; trained where not kept). Three cases, each
`--calls` forwards of `--rows` one-token rows (after 3 untimed), the cases interleaved per repeat:
every row on the base; the rows spread over the adapters (row i under adapter i mod N); every row
under the first adapter. Prints each case's median milliseconds per repeat. With `--products`,
the C kernel's products alone (`LoraSet.add_c` over every layer's four projections, random rows,
the same inputs each call, so hot in the caches) for the spread and one-adapter cases.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.lora_batch import adapter_args, parse_and_train
from spec import LLM
from verifier.batch import ForwardBatch, SeqInput
from verifier.cpu.machine import machine_summary
from verifier.model.lora import PROJECTIONS
from verifier.model.lora_adapter import part_sizes


def forward_ms(target, slots: list[int], calls: int) -> float:
    batch = ForwardBatch([SeqInput([100 + i], 0, [i], logits_indices=[0], sampled_from=0, adapter=s)
                          for i, s in enumerate(slots)])
    for _ in range(3):
        target.forward(batch)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        target.forward(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def products_ms(lora, cfg, slots: list[int], calls: int) -> float:
    """One pass of the C products over every layer and projection for rows under `slots`."""
    g = torch.Generator().manual_seed(0)
    shapes = {p: (parts[0][1], sum(o for o, _ in parts)) for p, parts in part_sizes(cfg).items()}
    xs = {p: torch.randn(len(slots), k, generator=g).bfloat16() for p, (k, _) in shapes.items()}
    ys = {p: torch.zeros(len(slots), n).bfloat16() for p, (_, n) in shapes.items()}
    times = []
    with lora.rows(slots, torch.device("cpu")):
        for _ in range(3 + calls):
            start = time.perf_counter()
            for layer in range(cfg.num_layers):
                for p in PROJECTIONS:
                    lora.add_c(layer, p, xs[p], ys[p])
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    adapter_args(ap)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--products", action="store_true", help="time the C products alone, not whole forwards")
    args, _, _, lora = parse_and_train(ap, argv)
    llm = LLM(model=args.model, lora_modules=lora, max_loras=len(lora), lora_dtype=args.lora_dtype,
              max_num_seqs=args.rows)
    slots = [llm.engine.adapters.slot(name) for name in lora]
    cases = {"base": [0] * args.rows, "spread": [slots[i % len(slots)] for i in range(args.rows)],
             "one adapter": [slots[0]] * args.rows}
    if args.products:
        del cases["base"]
    target, got = llm.engine.target, {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, case in cases.items():
            got[name].append(products_ms(llm.engine.adapters.lora, target.config, case, args.calls) if args.products
                             else forward_ms(target, case, args.calls))
    print(f"bench lora_step: {machine_summary()}; {len(lora)} adapters of rank {args.rank} on {args.modules}, "
          f"held in {args.lora_dtype}; {args.rows} decode rows{'; the products alone' if args.products else ''}",
          file=sys.stderr)
    for name, ms in got.items():
        print(f"{name}: " + ", ".join(f"{m:.2f}" for m in ms) + " ms")


if __name__ == "__main__":
    main()
