"""bench/graph_steps.py's dry run: the tiny shape on the CPU, the Triton backend under the
interpreter, every (requests, rows) point timed eagerly and then from the fixed buffers
(uncaptured on the CPU, `GraphConfig(cpu_proof=True)`), the point past the buckets marked as
eager both times, and the trace of one step each way written; the lines that bench/gpu_check.sh's
summary keeps hold the table and the graphs' memory."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

from conftest import ROOT


def summary_filter() -> str:
    """The pattern bench/gpu_check.sh's `figures` keeps a stage's lines by, into its summary."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    return re.search(r"^figures\(\).*?grep -E '([^']+)'", script, re.S | re.M).group(1)


def test_dry_run_times_every_point_eagerly_and_from_the_buckets(tmp_path):
    trace = tmp_path / "step-trace.json.gz"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "TERCEL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}                 # the random model's folder
    # buckets of 1, 2 and 4 rows: 1 x 3 rows runs padded to 4, 2 x 3 rows past the buckets
    done = subprocess.run([sys.executable, "-m", "bench.graph_steps", "--device", "cpu", "--shapes", "tiny",
                           "--requests", "1,2", "--rows", "1,3", "--context", "16", "--max-rows", "4",
                           "--repeats", "1", "--trace", str(trace)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
             if line.startswith("| tiny |")]
    points = {(int(c[1]), int(c[2])): c for c in cells}
    assert set(points) == {(1, 1), (1, 3), (2, 1), (2, 3)}, done.stdout
    for (requests, rows), (_, _, _, eager, graphs, ratio) in points.items():
        assert float(eager) > 0 and float(graphs.split()[0]) > 0 and float(ratio) > 0
        assert graphs.endswith("(eager)") == (requests * rows > 4), graphs
    memory = [line for line in done.stdout.splitlines() if line.startswith("tiny: graphs' memory")]
    assert len(memory) == 1 and "uncaptured on the CPU" in memory[0] and "(3 buckets, up to 4 rows)" in memory[0]
    assert re.search(r"bit for bit at \d of 3 ", memory[0]), memory       # the three graphed points compared
    kept = [line for line in done.stdout.splitlines() if re.match(summary_filter(), line)]
    assert memory[0] in kept and all(f"| tiny | {r} | {n} |" in "\n".join(kept) for r, n in points)
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {"graphed step", "eager step"} <= {e.get("name") for e in events}
