"""`tercel chat` in a fresh process on the CPU: it answers, and exits without importing Triton
(whose bindings print leak warnings at exit: a user reads that as a crash report)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_chat_on_cpu_answers_and_prints_no_leak_warnings(smollm2_dir):     # the model is installed
    code = ("import sys\nfrom serving.cli import main\nrc = main(['chat', 'hi', '--max-tokens', '4'])\n"
            "print('triton imported' if 'triton' in sys.modules else 'no triton', file=sys.stderr)\nsys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "nanobind" not in run.stderr
    assert "no triton" in run.stderr
