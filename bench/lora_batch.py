"""Multi-LoRA throughput: one batch of requests spread over several LoRA adapters against the same
requests on the base model, with and without a drafter, in one process per drafter.

    python -m bench.lora_batch --adapters 4 --requests 8 --rounds 3 --drafters none,suffix
    python -m bench.lora_batch --drafters small:smollm2-135m-instruct --whole-trees [--draft-own]

The adapters are real fine-tunes of the served model (default: the int4 SmolLM2-135M): each a
LoRA of rank `--rank` on `--modules` (default q/k/v/o/gate/up/down; PEFT, B starting at zero) trained for
`--train-steps` steps of next-token loss on the conversations of one source of
`../shared/data/train` (GSM8K, code, role-play, harmless dialogue), written under `--out` and kept
for the next run. Each round takes `--requests` new prompts (user turns of those sources, never
trained on, one source per adapter in turn) and runs them greedily twice, under the adapters (the
i-th prompt under adapter i mod N) and on the base, the order alternating by round, after one short
warm-up batch of each; every reply runs to `--max-tokens` (EOS ignored, as vLLM's throughput
benchmark; `--stop-at-eos` to stop), so that both modes make the same tokens and the ratio is the
adapters' cost, not their replies' lengths; tok/s is output tokens over the batch's wall time, medians over rounds; tau is tokens per verify step (with
`--whole-trees`, of every draft; otherwise of those the cost model chose to verify).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from drafters.conversations import load_conversations
from spec import LLM
from spec.adaptive import AdaptiveConfig
from spec.llm import chat_token_ids
from verifier.cpu.machine import machine_summary
from verifier.model.loader import ALIASES, resolve_model_dir
from verifier.model.tokenizer import Tokenizer
from verifier.sampling.sampling_params import SamplingParams

SOURCES = ("gsm8k_train", "gpteacher_codegen", "gpteacher_roleplay", "hh_rlhf_harmless", "math")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def source_conversations(name: str, data: Path) -> list[list[dict]]:
    convs, _ = load_conversations([str(data / f"{name}.jsonl")])
    return [list(c.messages) for c in convs if len(c.messages) >= 2]


def train_adapter(gguf: Path, convs: list[list[dict]], tokenizer, out: Path, rank: int, modules: list[str],
                  steps: int, seed: int) -> Path:
    """A LoRA of the dense model fine-tuned on `convs` (4 conversations a step, 256 tokens at most)."""
    import peft  # lazy: a dev dependency, not a core one (3.4 s to import); only training an adapter needs it
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        batch = [list(tokenizer.apply_chat_template(c, add_generation_prompt=False, tokenize=True))[:256]
                 for c in convs[4 * step:4 * step + 4]]
        width = max(map(len, batch))
        ids = torch.tensor([b + [0] * (width - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            print(f"  {out.name} step {step}: loss {loss.item():.3f}", file=sys.stderr)
    model.save_pretrained(str(out))
    return out


def adapter_args(ap) -> None:
    """The flags naming the served model, its adapters and the threads (bench.lora_step takes them too)."""
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--adapters", type=int, default=4, choices=range(1, len(SOURCES) + 1))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", default=",".join(TARGETS), help="the projections the adapters adapt")
    ap.add_argument("--lora-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/lora_adapters")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "train"))


def parse_and_train(ap: argparse.ArgumentParser, argv: list[str] | None):
    """(args, tokenizer, the training data's folder, name -> adapter folder): the flags parsed
    (`adapter_args` among them), torch's threads set, the adapters not kept trained."""
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = Path(args.data)
    if not data.is_dir():
        ap.error(f"no training conversations at {data} (--data)")
    tokenizer = Tokenizer(resolve_model_dir(args.model))
    return args, tokenizer, data, adapters(args, tokenizer, data)


def adapters(args, tokenizer, data: Path) -> dict[str, str]:
    """name -> folder: the first `--adapters` sources' fine-tunes, trained where not kept."""
    gguf = ALIASES[args.model]() if args.model in ALIASES else Path(args.model)
    made = {}
    for i, source in enumerate(SOURCES[:args.adapters]):
        tag = "all" if args.modules == ",".join(TARGETS) else args.modules.replace("_proj", "").replace(",", "")
        out = Path(args.out) / f"{source}-r{args.rank}-{tag}-s{args.train_steps}"
        if not (out / "adapter_model.safetensors").is_file():
            convs = source_conversations(source, data)[:4 * args.train_steps]
            train_adapter(gguf, convs, tokenizer, out, args.rank, args.modules.split(","), args.train_steps, i)
        made[source] = str(out)
    return made


def prompts(tokenizer, data: Path, sources: list[str], n: int, rounds: int, skip: int) -> list[list[list[int]]]:
    """Per round, n chat prompts (user turns past the ones trained on), the i-th from source i mod len."""
    pools = {s: source_conversations(s, data)[skip:] for s in sources}
    out = []
    for r in range(rounds):
        out.append([chat_token_ids(tokenizer, pools[sources[i % len(sources)]][r * n + i][:1]) for i in range(n)])
    return out


def run(llm, batch: list[list[int]], names: list[str | None], max_tokens: int, ignore_eos: bool) -> tuple[float, float]:
    """(output tok/s of the batch, tokens per verify step or 0)."""
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos), lora=names)
    seconds = time.perf_counter() - start
    steps = sum(o.stats.verify_steps for o in outs)
    return sum(len(o.token_ids) for o in outs) / seconds, sum(o.stats.emitted_tokens for o in outs) / steps \
        if steps else 0.0


def measure(args, lora: dict[str, str], batches: list[list[list[int]]], drafter: str | None) -> dict:
    own = lora if args.draft_own and drafter and drafter.startswith("small:") else {}
    llm = LLM(model=args.model, lora_modules=lora, max_loras=max(1, len(lora)), drafter=drafter,
              max_num_seqs=args.requests, adaptive=AdaptiveConfig(enabled=not args.whole_trees),
              lora_dtype=args.lora_dtype, draft_lora_modules=own)
    names = list(lora)
    spread = [names[i % len(names)] for i in range(args.requests)]
    rows: dict[str, list[tuple[float, float]]] = {"adapters": [], "base": []}
    for warm in (spread, [None] * args.requests):           # tables built, caches warm
        run(llm, batches[0], warm, 8, True)
    for r, batch in enumerate(batches):
        order = ("adapters", "base") if r % 2 == 0 else ("base", "adapters")
        for mode in order:
            rows[mode].append(run(llm, batch, spread if mode == "adapters" else [None] * len(batch), args.max_tokens,
                                  not args.stop_at_eos))
    ratios = [a / b for (a, _), (b, _) in zip(rows["adapters"], rows["base"])]
    return {"base": statistics.median(t for t, _ in rows["base"]),
            "adapters": statistics.median(t for t, _ in rows["adapters"]),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "tau_base": statistics.median(tau for _, tau in rows["base"]),
            "tau_adapters": statistics.median(tau for _, tau in rows["adapters"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    adapter_args(ap)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stop-at-eos", action="store_true", help="end replies at EOS (their lengths then differ by mode)")
    ap.add_argument("--drafters", default="none,suffix")
    ap.add_argument("--whole-trees", action="store_true",
                    help="verify every draft whole (the cost model off): tau compares the drafts, not its choices")
    ap.add_argument("--draft-own", action="store_true",
                    help="a small: drafter of the served model drafts under its own copy of each adapter, "
                         "not for the base (draft_lora_modules)")
    args, tokenizer, data, lora = parse_and_train(ap, argv)
    batches = prompts(tokenizer, data, list(lora), args.requests, args.rounds, skip=4 * args.train_steps)
    print(f"bench lora_batch: {machine_summary()}; {len(lora)} adapters of rank {args.rank} on {args.modules}, "
          f"held in {args.lora_dtype}", file=sys.stderr)
    print("| drafter | base tok/s | adapters tok/s | adapters / base (per round) | tau base | tau adapters |")
    print("|---|---|---|---|---|---|")
    for drafter in args.drafters.split(","):
        m = measure(args, lora, batches, None if drafter == "none" else drafter)
        each = ", ".join(f"{r:.2f}" for r in m["ratios"])
        print(f"| {drafter} | {m['base']:.1f} | {m['adapters']:.1f} | {m['ratio']:.2f}x ({each}) | "
              f"{m['tau_base']:.2f} | {m['tau_adapters']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
