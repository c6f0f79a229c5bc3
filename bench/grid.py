"""The configurations a benchmark measures (cells), built from the command line's ranges.

A cell is one drafter with one tree shape at one temperature and one quantization; drafter
None is the plain engine, measured in the same run as the baseline of every speedup (the
plain engine at the first quantization listed).
"""
from __future__ import annotations

from dataclasses import dataclass

from drafters.config import SpecConfig

PLAIN = "plain"
TERCEL, HF_GENERATE, HF_LOOKUP, LLAMACPP = "tercel", "hf-generate", "hf-prompt-lookup", "llama.cpp"  # engines


@dataclass(frozen=True)
class Cell:
    drafter: str | None              # None: plain decoding
    gamma: int | None = None         # None: the drafter's default tree
    topk: int | None = None
    budget: int | None = None        # None: gamma × topk
    temperature: float = 0.0
    engine: str = TERCEL             # or a baseline: HF transformers, llama.cpp (drafter None)
    quantization: str = "auto"       # Tercel's target weights (LLM(quantization=...))

    @property
    def key(self) -> str:
        quant = f"|q{self.quantization}" if self.quantization != "auto" else ""
        return f"{self.name}|g{self.gamma}|k{self.topk}|b{self.budget}|t{self.temperature:g}{quant}"

    @property
    def name(self) -> str:
        if self.engine != TERCEL:
            return self.engine
        return (self.drafter or PLAIN) + (f" [{self.quantization}]" if self.quantization != "auto" else "")

    @property
    def tree(self) -> str:
        """`γ4 k2 n4`, `default` or `-` (plain)."""
        if self.engine == HF_LOOKUP:
            return f"γ{self.gamma}"
        if self.drafter is None:
            return "-"
        if self.gamma is None:
            return "default"
        return f"γ{self.gamma} k{self.topk}" + (f" n{self.budget}" if self.budget else "")

    def speculation(self) -> SpecConfig | None:
        if self.drafter is None or self.gamma is None:
            return None
        return SpecConfig(num_speculative_tokens=self.gamma, topk=self.topk or 1, budget=self.budget)


def parse_range(text: str | None, name: str, minimum: int = 1) -> list[int] | None:
    """`4`, `1:8` (inclusive), `2:8:2` (with a step) or `1,2,4`; ValueError names the flag."""
    if text is None or text == "":
        return None
    usage = f"--{name} takes N, A:B, A:B:STEP or a,b,c; got {text!r}"
    try:
        parts = [int(x) for x in text.split(":" if ":" in text else ",")]
    except ValueError:
        raise ValueError(usage) from None
    if ":" in text:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
            raise ValueError(usage)
        if parts[1] < parts[0]:
            raise ValueError(f"--{name} {text}: the end is below the start")
        parts = list(range(parts[0], parts[1] + 1, parts[2] if len(parts) == 3 else 1))
    if min(parts) < minimum:
        raise ValueError(f"--{name} values must be >= {minimum}, got {text!r}")
    return sorted(set(parts))


def parse_floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} takes numbers separated by commas, got {text!r}") from None
    if any(v < 0 for v in values):
        raise ValueError(f"--{name} values must be >= 0, got {text!r}")
    return list(dict.fromkeys(values))


def build_cells(drafters: list[str], gammas: list[int] | None, topks: list[int] | None,
                budgets: list[int] | None, temperatures: list[float],
                quantizations: tuple[str, ...] = ("auto",)) -> list[Cell]:
    """The plain engine plus every drafter × γ × top-k × budget × temperature that can exist,
    at each quantization. No γ given: each drafter's default tree. A chain (top-k 1) ignores
    budgets. Combinations with budget < γ are left out; ValueError when that leaves none."""
    if budgets and gammas and max(budgets) < min(gammas):
        raise ValueError(f"--budget {max(budgets)} is below every --gamma (min {min(gammas)}): "
                         "a tree needs at least γ nodes for its deepest path")
    if (topks or budgets) and not gammas:
        raise ValueError("--topk and --budget need --gamma (without it each drafter uses its default tree)")
    cells = []
    for t in temperatures:
        for q in quantizations:
            cells.append(Cell(None, temperature=t, quantization=q))
            for d in drafters:
                cells += [Cell(d, g, k, b, t, quantization=q) for g, k, b in _shapes(gammas, topks, budgets)]
    return cells


def _shapes(gammas, topks, budgets):
    if not gammas:
        return [(None, None, None)]
    out = []
    for g in gammas:
        for k in topks or [1]:
            if k == 1 or not budgets:
                out.append((g, k, None))
            else:
                out += [(g, k, b) for b in budgets if b >= g]
    return list(dict.fromkeys(out))
