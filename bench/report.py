"""Markdown tables for `tercel bench accept | grid | speed` (printed on stdout)."""
from __future__ import annotations

from bench.grid import Cell
from bench.stats import DEFINITIONS


def _f(v, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def _x(v, rng=None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and rng[0] != rng[1] else "")


def _alphas(values) -> str:
    return " ".join("-" if a is None else f"{a:.2f}" for a in values) or "-"


def _label(row: dict) -> tuple[str, str, str, str]:
    cell = Cell(**row["cell"])
    return row["task"], f"{cell.temperature:g}", cell.name, cell.tree


def accept_table(rows: list[dict]) -> str:
    lines = ["| task | T | drafter | tree | τ | α cumulative (depth 1..) | α conditional | "
             "draft ms/step | verify ms/step |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["cell"]["drafter"] is None:
            continue
        lines.append("| " + " | ".join([*_label(row), _f(row["tau"]), _alphas(row["alpha_cumulative"]),
                                        _alphas(row["alpha_conditional"]), _f(row["draft_ms_per_step"], ".1f"),
                                        _f(row["verify_ms_per_step"], ".1f")]) + " |")
    return "\n".join(lines) + "\n\n" + DEFINITIONS


def grid_table(rows: list[dict]) -> str:
    lines = ["| task | T | drafter | tree | tok/s | speedup (min-max) | vs HF generate | τ | α cumulative |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append("| " + " | ".join([*_label(row), _f(row["tok_s"], ".1f"), _x(row["speedup"], row["speedup_range"]),
                                        _x(row["speedup_vs_hf"]), _f(row["tau"]),
                                        _alphas(row["alpha_cumulative"])]) + " |")
    return "\n".join(lines)


def best_table(best: dict[str, dict], rows: list[dict]) -> str:
    """The fastest configuration per task, with its speedups over plain and over HF."""
    lines = ["| task | best configuration | τ | speedup vs plain | vs HF generate |", "|---|---|---|---|---|"]
    for task, b in best.items():
        vs_hf = [r["speedup_vs_hf"] for r in rows if r["task"] == task and _same(r["cell"], b)
                 and r["speedup_vs_hf"] is not None]
        lines.append(f"| {task} | {describe(b)} | {_f(b['tau'])} | {b['speedup']:.2f}x | "
                     f"{_x(sum(vs_hf) / len(vs_hf) if vs_hf else None)} |")
    return "\n".join(lines)


def speed_table(rows: list[dict]) -> str:
    llama = any(row.get("speedup_vs_llamacpp") is not None for row in rows)
    lines = ["| task | T | engine | tree | tok/s | TTFT ms | speedup vs plain | vs HF generate | "
             + ("vs llama.cpp | " if llama else "") + "τ |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if llama else "")]
    for row in rows:
        cells = [*_label(row), _f(row["tok_s"], ".1f"), _f(row["ttft_ms"], ".0f"),
                 _x(row["speedup"], row["speedup_range"]), _x(row["speedup_vs_hf"])]
        cells += [_x(row.get("speedup_vs_llamacpp"))] if llama else []
        lines.append("| " + " | ".join(cells + [_f(row["tau"])]) + " |")
    return "\n".join(lines)


def describe(choice: dict) -> str:
    if choice["drafter"] is None:
        return "plain (no speculation)"
    if choice["gamma"] is None:
        return f"{choice['drafter']} (default tree)"
    budget = f", {choice['budget']} nodes" if choice.get("budget") else ""
    return f"{choice['drafter']} γ={choice['gamma']} top-k={choice['topk']}{budget}"


def _same(cell: dict, choice: dict) -> bool:
    return all(cell[k] == choice[k] for k in ("drafter", "gamma", "topk", "budget"))
