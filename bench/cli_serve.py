"""`tercel bench serve`: the load generator against a running server (bench.serve_load)."""
from __future__ import annotations

import sys

from bench.agent_workload import agent_specs
from bench.cli_args import split_names, write_plots
from bench.data import Dataset, load_datasets
from bench.grid import parse_floats, parse_range
from bench.journal import Journal
from bench.serve_load import LoadConfig, markdown_table, plot_latency, run_serve_bench
from bench.workloads import multiturn


def run_serve_bench_cli(args) -> int:
    temps = parse_floats(args.temperature, "temperature")
    cfg = LoadConfig(url=args.url.rstrip("/"), concurrency=tuple(parse_range(args.concurrency, "concurrency")),
                     max_tokens=args.max_tokens, temperature=temps[0], requests_per_level=args.requests,
                     api_key=args.api_key, model=args.model, repeats=args.repeats or 1,
                     modes=tuple(split_names(args.modes)))
    if args.dataset == ["multiturn"]:       # conversations under shared system prompts (bench/workloads.py)
        data = Dataset(multiturn(args.limit))
    elif args.dataset == ["agent"]:         # agent loops and code edits (bench/agent_workload.py)
        data = Dataset(agent_specs(args.limit))
    else:
        data = load_datasets(args.dataset or ["mtbench"], split_names(args.tasks), args.limit)
    for line in data.skipped:
        print(f"skipped {line}", file=sys.stderr)
    print(f"bench serve: {cfg.url}, levels {list(cfg.concurrency)}, "
          f"speculation {' and '.join(cfg.modes)}, {len(data.prompts)} prompt(s)", file=sys.stderr)
    journal = Journal(args.json, "serve", {"url": cfg.url, "max_tokens": cfg.max_tokens,
                                           "temperature": cfg.temperature, "model": cfg.model,
                                           "prompts": [f"{p.task}/{p.id}" for p in data.prompts]}, args.resume)
    run_serve_bench(cfg, list(data.prompts), done=journal.done, on_result=journal.add)
    print(markdown_table(journal.results))
    journal.save({"levels": journal.results})
    write_plots(plot_latency, journal.results, args.plot)
    return 0
