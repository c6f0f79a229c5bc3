"""Shared fixtures. Tests run on the CPU; the default model is loaded once per session."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("TERCEL_DATA", ROOT.parent / "shared" / "data"))


def mtbench_prompts(n: int) -> list[str]:
    path = SHARED_DATA / "mtbench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]
