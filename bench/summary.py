"""From per-unit results to per-cell figures: medians over repeats, speedups as ratios of
runs made in the same repeat (same task, same temperature), the best cell per task.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

from bench.grid import HF_GENERATE, LLAMACPP, PLAIN, TERCEL
from bench.stats import acceptance, add_depths


def summarise(results: list[dict]) -> list[dict]:
    """One row per (task, cell) in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["task"], r["cell_key"])].append(r)
    baseline = _baselines(results)
    return [_row(task, runs, baseline) for (task, _), runs in groups.items()]


def _baselines(results: list[dict]) -> dict[tuple[str, float, int, str], float]:
    """tok/s of the plain engine (at the first quantization measured), HF generate and
    llama.cpp per (task, temperature, repeat)."""
    out, plain_quant = {}, None
    for r in results:
        cell = r["cell"]
        if cell["drafter"] is not None:
            continue
        name = PLAIN if cell["engine"] == TERCEL else cell["engine"]
        if name == PLAIN:
            plain_quant = plain_quant or cell.get("quantization", "auto")
            if cell.get("quantization", "auto") != plain_quant:
                continue
        if name in (PLAIN, HF_GENERATE, LLAMACPP):
            out[(r["task"], cell["temperature"], r["repeat"], name)] = r["tok_s"]
    return out


def _ratios(runs: list[dict], baseline: dict, name: str) -> list[float]:
    out = []
    for r in runs:
        base = baseline.get((r["task"], r["cell"]["temperature"], r["repeat"], name))
        if base:
            out.append(r["tok_s"] / base)
    return out


def _row(task: str, runs: list[dict], baseline: dict) -> dict:
    cell = runs[0]["cell"]
    steps = sum(r["verify_steps"] for r in runs)
    acc = acceptance(steps, sum(r["emitted"] for r in runs),
                     _sum_depths(r["accepted_per_depth"] for r in runs))
    speedup, vs_hf = _ratios(runs, baseline, PLAIN), _ratios(runs, baseline, HF_GENERATE)
    return {
        "task": task, "cell": cell, "cell_key": runs[0]["cell_key"], "repeats": len(runs),
        "tok_s": _med([r["tok_s"] for r in runs]), "tok_s_range": _range([r["tok_s"] for r in runs]),
        "ttft_ms": _med([r["ttft_ms"] for r in runs]),
        "speedup": _med(speedup), "speedup_range": _range(speedup), "speedup_vs_hf": _med(vs_hf),
        "speedup_vs_llamacpp": _med(_ratios(runs, baseline, LLAMACPP)),
        "tau": acc.tau, "alpha_cumulative": list(acc.cumulative), "alpha_conditional": list(acc.conditional),
        "draft_ms_per_step": _med([r["draft_ms_per_step"] for r in runs if r["draft_ms_per_step"] is not None]),
        "verify_ms_per_step": _med([r["verify_ms_per_step"] for r in runs if r["verify_ms_per_step"] is not None]),
        "tokens": sum(r["tokens"] for r in runs),
    }


def _sum_depths(lists) -> list[int]:
    total: list[int] = []
    for d in lists:
        total = add_depths(total, d)
    return total


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _range(values: list[float]) -> list[float] | None:
    return [min(values), max(values)] if values else None


def best_per_task(rows: list[dict]) -> dict[str, dict]:
    """Per task, the Tercel configuration (plain included) with the best geometric-mean
    speedup over the temperatures measured."""
    by_task: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["speedup"] is not None and row["cell"]["engine"] == TERCEL:
            by_task[row["task"]][_config_key(row["cell"])].append(row)
    out = {}
    for task, configs in by_task.items():
        key, picked = max(configs.items(), key=lambda kv: _geomean([r["speedup"] for r in kv[1]]))
        out[task] = _choice(picked)
    return out


def best_overall(rows: list[dict]) -> dict | None:
    """The configuration with the best geometric-mean speedup over every task and temperature
    (only configurations measured on all of them compete)."""
    configs: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["speedup"] is not None and row["cell"]["engine"] == TERCEL:
            configs[_config_key(row["cell"])].append(row)
    if not configs:
        return None
    most = max(len(v) for v in configs.values())
    complete = {k: v for k, v in configs.items() if len(v) == most}
    _, picked = max(complete.items(), key=lambda kv: _geomean([r["speedup"] for r in kv[1]]))
    return _choice(picked)


def _choice(rows: list[dict]) -> dict:
    c = rows[0]["cell"]
    taus = [r["tau"] for r in rows if r["tau"] is not None]
    return {"drafter": c["drafter"], "gamma": c["gamma"], "topk": c["topk"], "budget": c["budget"],
            "speedup": round(_geomean([r["speedup"] for r in rows]), 4),
            "tau": round(statistics.mean(taus), 4) if taus else None,
            "temperatures": sorted({r["cell"]["temperature"] for r in rows})}


def _config_key(cell: dict) -> str:
    return f"{cell['drafter']}|{cell['gamma']}|{cell['topk']}|{cell['budget']}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
