"""Benchmark prompt sets read from the shared data folder (never copied into the repo)."""
from __future__ import annotations

import json
import os
from pathlib import Path

DATA = Path(os.environ.get("TERCEL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"dataset not found: {path} (set TERCEL_DATA to the data folder)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_first_turns(limit: int | None = None) -> list[str]:
    rows = _rows(DATA / "mtbench" / "question.jsonl")
    return [r["turns"][0] for r in rows[:limit]]


def specbench_prompts(tasks: list[str] | None = None, limit: int | None = None) -> dict[str, list[str]]:
    """First turns per Spec-Bench task (mt_bench categories fold into 'mt_bench')."""
    mt_categories = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    out: dict[str, list[str]] = {}
    for r in _rows(DATA / "specbench" / "question.jsonl"):
        task = "mt_bench" if r["category"] in mt_categories else r["category"]
        if tasks and task not in tasks:
            continue
        out.setdefault(task, [])
        if limit is None or len(out[task]) < limit:
            out[task].append(r["turns"][0])
    return out
