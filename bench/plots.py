"""PNG charts of a grid or accept run (matplotlib, imported only when --plot is given).

- tau_speedup_vs_gamma.png: τ and speedup over the plain engine against γ, one line per
  drafter and tree width (means over tasks), one figure column per temperature;
- acceptance_per_depth.png: cumulative acceptance α_d per depth for every configuration.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path


def pyplot():
    try:
        # lazy: matplotlib is tercel[bench]'s, needed only with --plot
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tercel[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: tercel[bench]'s, after the Agg backend is chosen
    return plt


def _series_label(cell: dict) -> str:
    width = f" top-k {cell['topk']}" if cell["topk"] and cell["topk"] > 1 else ""
    budget = f" {cell['budget']} nodes" if cell["budget"] else ""
    return f"{cell['drafter']}{width}{budget}"


def plot_grid(rows: list[dict], out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    speculative = [r for r in rows if r["cell"]["drafter"] is not None]
    if not speculative:
        return []
    return [_gamma_chart(plt, speculative, out_dir / "tau_speedup_vs_gamma.png"),
            _depth_chart(plt, speculative, out_dir / "acceptance_per_depth.png")]


def _gamma_chart(plt, rows: list[dict], path: Path) -> Path:
    temps = sorted({r["cell"]["temperature"] for r in rows})
    fig, axes = plt.subplots(2, len(temps), figsize=(5 * len(temps), 7), squeeze=False)
    for col, t in enumerate(temps):
        series: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["cell"]["temperature"] == t:
                # A drafter's default tree has no γ on the command line: plot it at γ = 0.
                series[_series_label(r["cell"])][r["cell"]["gamma"] or 0].append(r)
        ticks = sorted({g for by_gamma in series.values() for g in by_gamma})
        for label, by_gamma in series.items():
            gammas = sorted(by_gamma)
            for row, metric in ((0, "tau"), (1, "speedup")):
                ys = [_mean(x[metric] for x in by_gamma[g]) for g in gammas]
                axes[row][col].plot(gammas, ys, marker="o", label=label)
        axes[0][col].set_title(f"T = {t:g}")
        axes[0][col].set_ylabel("τ (tokens per verify step)")
        axes[1][col].set_ylabel("speedup over plain")
        axes[1][col].axhline(1.0, color="grey", lw=0.8, ls="--")
        for row in (0, 1):
            axes[row][col].set_xticks(ticks)
            axes[row][col].set_xlabel("γ (speculation depth; 0 = the drafter's default tree)")
            axes[row][col].legend(fontsize=7)
    return save_figure(fig, path)


def _depth_chart(plt, rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    configs: dict[str, list[list[float]]] = defaultdict(list)
    for r in rows:
        c = r["cell"]
        tree = f" γ{c['gamma']}" if c["gamma"] else ""
        configs[f"{_series_label(c)}{tree} T={c['temperature']:g}"].append(r["alpha_cumulative"])
    for label, alphas in configs.items():
        depth = max(len(a) for a in alphas)
        ys = [_mean(a[d] for a in alphas if d < len(a)) for d in range(depth)]
        ax.plot(range(1, depth + 1), ys, marker="o", label=label)
    ax.set_xticks(range(1, 1 + max((len(a) for alphas in configs.values() for a in alphas), default=1)))
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("cumulative acceptance α_d (share of verify steps)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else float("nan")    # nan: a gap in the line


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt  # lazy: tercel[bench]'s, needed only with --plot
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
