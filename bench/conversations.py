"""Interleaved conversations on one engine: time to first token of each turn and the prefix
cache's hits, as a chat server sees them (turn 1 of every conversation, then turn 2 of every
one, ...). All share a short system prompt; each opens with its own Spec-Bench summarization
article, so a later turn can reuse its whole conversation so far, if the cache kept it while
the other conversations ran.

    python -m bench.conversations --conversations 4 --turns 3 --threads 2
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.data import specbench_prompts
from spec import LLM, SamplingParams
from verifier.cpu.machine import machine_summary

SYSTEM = "You are a careful assistant. Answer in plain English, briefly, and say when you are unsure."
FOLLOW_UP = "Say more about that."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--article-chars", type=int, default=2500, help="each conversation's first message, cut here")
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=1)
    articles = specbench_prompts(["summarization"], args.conversations)["summarization"]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": a[:args.article_chars]}]
             for a in articles]
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    print(f"conversations: {machine_summary()}, {torch.get_num_threads()} threads\n")
    print("| turn | prompt tokens | from the prefix cache | TTFT ms, median (each) |\n|---|---|---|---|")
    for turn in range(1, args.turns + 1):
        ttfts, hits, queries = [], 0, 0
        for conv in convs:
            before = llm.engine.stats()
            out = llm.generate(llm.apply_chat_template(conv), params)[0]
            after = llm.engine.stats()
            ttfts.append(out.ttft * 1e3)
            hits += after.prefix_cache_hits - before.prefix_cache_hits
            queries += after.prefix_cache_queries - before.prefix_cache_queries
            conv += [{"role": "assistant", "content": llm.tokenizer.decode(out.token_ids)},
                     {"role": "user", "content": FOLLOW_UP}]
        each = ", ".join(f"{t:.0f}" for t in ttfts)
        print(f"| {turn} | {queries} | {hits} | {statistics.median(ttfts):.0f} ({each}) |")


if __name__ == "__main__":
    main()
