"""`python -m bench.predicted` on one edit with the tiny random model: it runs, reports every
column, writes its runs, and the outputs with and without the prediction are the same tokens
(no timing is asserted)."""
from __future__ import annotations

import json

import pytest

from bench.predicted import TASKS, main


def test_every_edit_task_still_finds_its_code():
    for task in TASKS:
        assert task.needs in task.code() and task.prediction().startswith("```python\n")


def test_one_tiny_edit_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "runs.json"
    assert main(["--model", str(tiny_llama_dir), "--limit", "1", "--repeats", "2", "--max-tokens", "12",
                 "--gamma", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "torch threads" in printed and "chain depth 3" in printed
    row = next(line for line in printed.splitlines() if line.startswith(f"| {TASKS[0].name} |"))
    assert row.rstrip().endswith("| yes |"), row
    runs = json.loads(out.read_text())[TASKS[0].name]
    assert [len(runs[m]) for m in ("plain", "predicted")] == [2, 2]
    assert all(r["ids"] == runs["plain"][0]["ids"] and r["tokens"] > 0 for rs in runs.values() for r in rs)


def test_bad_repeats_is_a_usage_error(tiny_llama_dir):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_llama_dir), "--repeats", "0"])
    assert e.value.code == 2
