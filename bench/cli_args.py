"""What the `tercel bench` subcommands share: comma-separated lists, the plots they write."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def split_names(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def write_plots(plot: Callable, rows, out_dir: str | None) -> None:
    """`plot(rows, out_dir)` -> the paths it wrote, each reported; nothing without `out_dir`."""
    if not out_dir:
        return
    for path in plot(rows, Path(out_dir)):
        print(f"wrote {path}", file=sys.stderr)
