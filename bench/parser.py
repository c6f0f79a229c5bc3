"""`tercel bench accept | grid | speed | serve | kernels | quality | structured | replay`.

    tercel bench accept --drafter ngram --gamma 1:6 --tasks rag,summarization --limit 10
    tercel bench grid --drafter ngram,eagle3:HEAD --gamma 2:6 --topk 1,2 --budget 4:8 \\
        --temperature 0,0.7 --repeats 3 --hf --json grid.json --plot charts/ --profile-out profile.json
    tercel bench speed --drafter ngram --limit 10 --max-tokens 128 --repeats 3
    tercel bench speed --quantization auto,none --llamacpp --dataset mtbench --limit 10
    tercel bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16
    tercel bench kernels
    tercel bench quality --quantization int4,int8 --limit 30
    tercel bench structured --drafter ngram,datastore:../shared/data/train --limit 16
    tercel bench replay --drafter suffix,ngram --tasks summarization,rag --limit 5 --ignore-eos

Every run prints markdown tables on stdout; --json keeps a machine-readable report that is
rewritten after each finished run, so an interrupted benchmark continues with --resume.
Bad input (unknown drafter or task, empty dataset, impossible ranges, unreachable server)
exits with code 2 and a message.
"""
from __future__ import annotations

import argparse

# `tercel serve` builds its parser with add_bench_args (serving/cli.py): this module imports
# nothing heavy; the subcommands load in bench/cli.py when `tercel bench` runs.
COMMANDS = ("accept", "grid", "speed", "serve", "kernels", "quality", "structured", "replay")
BENCH_EXTRA = ("httpx", "jsonschema", "matplotlib")     # tercel[bench]: not needed to serve


def add_bench_args(sub) -> None:
    p = sub.add_parser("bench", help="measure acceptance, grid-search trees, compare speeds, load a server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=COMMANDS)
    p.add_argument("--model", default=None, help="alias, .gguf or HF directory (default: smollm2-135m-instruct)")
    p.add_argument("--dataset", action="append", default=None,
                   help="specbench, mtbench or a JSONL file; repeatable (default: specbench); serve also takes "
                        "multiturn (two-turn conversations under shared system prompts) and agent (tool-call loops "
                        "and code edits, --limit sessions)")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--limit", type=int, default=10, help="prompts per task (default 10)")
    p.add_argument("--both-turns", action="store_true", help="MT-bench style: also the second turn")
    p.add_argument("--drafter", default="ngram", help="comma-separated drafters (default: ngram)")
    p.add_argument("--gamma", default=None, help="speculation depths, e.g. 4, 1:8, 2,4,6 (default: drafter's)")
    p.add_argument("--topk", default=None, help="tree widths, e.g. 1:3")
    p.add_argument("--budget", default=None, help="draft nodes per step, e.g. 4:16:4")
    p.add_argument("--temperature", default="0", help="comma-separated temperatures (default 0)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--repeats", type=int, default=None, help="runs of each cell (default: 1 accept and serve, 3 otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="grid: also measure HF transformers generate")
    p.add_argument("--llamacpp", action="store_true",
                   help="speed: also measure llama.cpp on the same GGUF (pip install -e '.[llamacpp]')")
    p.add_argument("--adaptive", action="store_true",
                   help="speculate as `tercel serve` does: off while it does not pay, trees sized to the step")
    p.add_argument("--quantization", default="auto",
                   help="target weights, comma-separated: auto, int4, int8, gguf, none (default auto; the first "
                        "listed is the plain baseline; quality: the modes compared with none)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="accept, grid, speed: shard Tercel's target over N devices (dense weights; "
                        "--quantization auto picks none)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--lora", default=None, metavar="NAME=PATH",
                   help="accept, grid, speed: every request under this LoRA adapter (PEFT folder); serve: a "
                        "server's adapter is a --model name")
    p.add_argument("--json", default=None, help="write the report here (updated as runs finish)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    p.add_argument("--profile-out", default=None, help="grid: write the fastest configuration per task")
    p.add_argument("--resume", action="store_true", help="continue the run whose --json report is given")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="serve: the server to load")
    p.add_argument("--concurrency", default="1,4,16", help="serve: concurrency levels")
    p.add_argument("--requests", type=int, default=None, help="serve: requests per level")
    p.add_argument("--api-key", default=None, help="serve: Bearer key of the server")
    p.add_argument("--modes", default="on,off", help="serve: speculation modes to measure, on and/or off")
