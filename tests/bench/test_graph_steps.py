"""bench/graph_steps.py's dry run: the tiny shape on the CPU, the Triton backend under the
interpreter, every (requests, rows) point timed eagerly and then from the fixed buffers
(uncaptured on the CPU, `GraphConfig(cpu_proof=True)`), the point past the buckets marked as
eager both times, and the trace of one step each way written."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

from conftest import ROOT


def test_dry_run_times_every_point_eagerly_and_from_the_buckets(tmp_path):
    trace = tmp_path / "step-trace.json.gz"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "TERCEL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    # buckets of 1, 2 and 4 rows: 1 x 3 rows runs padded to 4, 2 x 3 rows past the buckets
    done = subprocess.run([sys.executable, "-m", "bench.graph_steps", "--device", "cpu", "--shapes", "tiny",
                           "--requests", "1,2", "--rows", "1,3", "--context", "16", "--max-rows", "4",
                           "--repeats", "1", "--trace", str(trace)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
             if line.startswith("| tiny |")]
    points = {(int(c[1]), int(c[2])): c for c in cells if len(c) == 6}
    assert set(points) == {(1, 1), (1, 3), (2, 1), (2, 3)}, done.stdout
    for (requests, rows), (_, _, _, eager, graphs, ratio) in points.items():
        assert float(eager) > 0 and float(graphs.split()[0]) > 0 and float(ratio) > 0
        assert graphs.endswith("(eager)") == (requests * rows > 4), graphs
    memory = [c for c in cells if len(c) == 5]
    assert len(memory) == 1 and memory[0][1] == "3, up to 4 rows" and memory[0][2] == "uncaptured (CPU)"
    assert re.match(r"\d of 3 bit for bit", memory[0][4]), memory      # the three graphed points compared
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {"graphed step", "eager step"} <= {e.get("name") for e in events}
