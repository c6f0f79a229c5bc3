"""Where `make test`'s memory goes: a pytest plugin that writes, for each test, its seconds and
the process's resident and peak memory after it, and at each module's end (its fixtures torn
down, a collection run) the engines still alive and the resident memory.

    .venv/bin/python -m pytest -q -p bench.suite_memory            # appends to suite_memory.jsonl
    SUITE_MEMORY=out.jsonl .venv/bin/python -m pytest -q -p bench.suite_memory tests/serving/test_server.py

Read it with `python -m bench.suite_memory out.jsonl`: the tests that raised the peak, and the
slowest modules (docs/performance.md, "Test suite")."""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import Counter

import pytest

from spec.engine import LLMEngine

_out = None


def _memory() -> dict[str, int]:
    """VmRSS and VmHWM in MiB (Linux)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) // 1024
    return found


def _write(row: dict) -> None:
    """Appends: tests that run pytest in a child process inherit the plugin and write there too."""
    global _out
    if _out is None:
        _out = open(os.environ.get("SUITE_MEMORY", "suite_memory.jsonl"), "a")
    _out.write(json.dumps({**row, "pid": os.getpid()}) + "\n")
    _out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    m = _memory()
    _write({"test": item.nodeid, "s": round(time.perf_counter() - start, 2), "rss": m["VmRSS"], "peak": m["VmHWM"]})


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is None or nextitem.module is not item.module:   # the module's fixtures are gone
        gc.collect()
        engines = sum(isinstance(o, LLMEngine) for o in gc.get_objects())
        _write({"module": item.module.__name__, "engines": engines, "rss": _memory()["VmRSS"]})


def report(path: str) -> str:
    """The suite's own process: the one that wrote the most rows (children run a few tests)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    main = Counter(r.get("pid") for r in rows).most_common(1)[0][0]
    rows = [r for r in rows if r.get("pid") == main]
    tests = [r for r in rows if "test" in r]
    lines, peak = ["Tests that raised the peak (MiB):"], 0
    for r in tests:
        if r["peak"] > peak + 256:
            lines.append(f"  {r['peak']:6d}  {r['test']}")
        peak = max(peak, r["peak"])
    per_module = Counter()
    for r in tests:
        per_module[r["test"].split("::")[0]] += r["s"]
    lines += ["", f"Slowest modules (of {sum(per_module.values()):.0f} s in tests):"]
    lines += [f"  {s:6.1f} s  {m}" for m, s in per_module.most_common(15)]
    live = [r for r in rows if r.get("engines")]
    lines += ["", "Modules that left engines alive: " + (", ".join(r["module"] for r in live) or "none")]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1] if len(sys.argv) > 1 else "suite_memory.jsonl"))
