"""`tercel bench accept | grid | speed`: batch-1 runs of engine configurations on a dataset."""
from __future__ import annotations

import sys

from bench import report
from bench.cli_args import split_names, write_plots
from bench.data import load_datasets
from bench.grid import HF_GENERATE, HF_LOOKUP, LLAMACPP, Cell, build_cells, parse_floats, parse_range
from bench.journal import Journal
from bench.llamacpp import check_llamacpp
from bench.plots import plot_grid
from bench.runner import RunSettings
from bench.suite import run_suite
from bench.summary import best_overall, best_per_task, summarise
from drafters.kinds import check_drafter
from spec.config import QUANTIZATION_CHOICES
from spec.profile import write_profile
from verifier.cpu.machine import default_threads
from verifier.model.loader import DEFAULT_MODEL

HF_LOOKUP_TOKENS = 10     # transformers' own default for prompt_lookup_num_tokens


def run_engine_bench(args) -> int:
    drafters = _drafters(args.drafter)
    temps = parse_floats(args.temperature, "temperature")
    if args.lora and (args.hf or args.llamacpp):
        raise ValueError("--lora runs Tercel's engines under an adapter; --hf and --llamacpp have no such baseline")
    if args.llamacpp:
        if args.what != "speed":
            raise ValueError("--llamacpp is a baseline of `tercel bench speed`")
        check_llamacpp(args.model or DEFAULT_MODEL)
    cells = _cells(args.what, drafters, args, temps)
    data = load_datasets(args.dataset or ["specbench"], split_names(args.tasks), args.limit, args.both_turns)
    for line in data.skipped:
        print(f"skipped {line}", file=sys.stderr)
    repeats = args.repeats if args.repeats is not None else (1 if args.what == "accept" else 3)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    settings = RunSettings(args.model or DEFAULT_MODEL, args.max_tokens, args.ignore_eos, args.seed, args.adaptive,
                           args.tensor_parallel_size, _lora(args.lora))
    journal = Journal(args.json, args.what, _fingerprint(settings, args, data), args.resume)
    by_task = data.by_task()
    print(f"bench {args.what}: {len(cells)} configuration(s) × {len(by_task)} task(s) × {repeats} repeat(s), "
          f"{len(data.prompts)} prompt(s), {args.max_tokens} tokens, {_threads()} torch thread(s)", file=sys.stderr)
    run_suite(cells, by_task, repeats, settings, journal)
    rows = summarise(journal.results)
    _report(args, rows, journal, settings)
    return 0


def _report(args, rows, journal: Journal, settings: RunSettings) -> None:
    summary = {"threads": _threads(), "rows": rows}
    if args.what == "accept":
        print(report.accept_table(rows))
    elif args.what == "speed":
        print(report.speed_table(rows))
    else:
        best = best_per_task(rows)
        default = best_overall(rows)
        summary.update(best_per_task=best, best_overall=default)
        print(report.grid_table(rows) + "\n\nFastest configuration per task:\n\n" + report.best_table(best, rows))
        if default:
            print(f"\nOverall (geometric mean over tasks and temperatures): {report.describe(default)}, "
                  f"{default['speedup']:.2f}x")
        if args.profile_out and default:
            write_profile(args.profile_out, settings.model, default, best)
            print(f"wrote profile {args.profile_out}", file=sys.stderr)
    journal.save(summary)
    write_plots(plot_grid, rows, args.plot)


def _drafters(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip() and d.strip() not in ("none", "plain")]
    for d in names:
        check_drafter(d)
    return names



def _cells(what: str, drafters: list[str], args, temps: list[float]) -> list[Cell]:
    gammas = parse_range(args.gamma, "gamma")
    topks, budgets = parse_range(args.topk, "topk"), parse_range(args.budget, "budget")
    if what == "accept" and not drafters:
        raise ValueError("bench accept needs at least one --drafter")
    cells = build_cells(drafters, gammas, topks, budgets, temps, quantizations(args.quantization))
    if what == "accept":
        return [c for c in cells if c.drafter is not None]
    if what == "speed" or args.hf:
        cells += [Cell(None, temperature=t, engine=HF_GENERATE) for t in temps]
    if what == "speed":
        lookup = gammas[0] if gammas else HF_LOOKUP_TOKENS
        cells += [Cell(None, gamma=lookup, temperature=t, engine=HF_LOOKUP) for t in temps]
    if args.llamacpp:
        cells += [Cell(None, temperature=t, engine=LLAMACPP) for t in temps]
    return cells


def quantizations(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(q.strip() for q in text.split(",") if q.strip()))
    bad = [q for q in names if q not in QUANTIZATION_CHOICES]
    if bad or not names:
        raise ValueError(f"--quantization takes {', '.join(QUANTIZATION_CHOICES)} (comma-separated), got {text!r}")
    return names


def _fingerprint(settings: RunSettings, args, data) -> dict:
    """What must not change between an interrupted run and its --resume."""
    return {"model": settings.model, "max_tokens": settings.max_tokens, "ignore_eos": settings.ignore_eos,
            "seed": settings.seed, "datasets": args.dataset or ["specbench"], "both_turns": args.both_turns,
            "quantization": args.quantization, "adaptive": args.adaptive,
            "lora": list(settings.lora) if settings.lora else None,
            "prompts": [f"{p.task}/{p.id}" for p in data.prompts]}


def _lora(arg: str | None) -> tuple[str, str] | None:
    if arg is None:
        return None
    name, sep, path = arg.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH, got {arg!r}")
    return name, path


def _threads() -> int:
    return default_threads()
