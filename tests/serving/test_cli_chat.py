"""`tercel chat` in a fresh process on the CPU: it answers, and exits without importing Triton
(whose bindings print leak warnings at exit: a user reads that as a crash report); a process
that did import it (transformers does, through torch._dynamo) still exits quietly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_chat_on_cpu_answers_and_prints_no_leak_warnings(smollm2_dir):     # the model is installed
    code = ("import sys\nfrom serving.cli import main\nrc = main(['chat', 'hi', '--max-tokens', '4'])\n"
            "print('triton imported' if 'triton' in sys.modules else 'no triton', file=sys.stderr)\nsys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "nanobind" not in run.stderr
    assert "no triton" in run.stderr


def test_an_engine_beside_triton_exits_without_leak_warnings(tiny_llama_dir):
    """A server freezes what it loaded out of the GC's reach (`freeze_loaded_objects`, as `tercel
    serve` does after loading); at exit it must be collectable again."""
    pytest.importorskip("triton", reason="triton is not installed: nothing to leak")
    code = ("import sys, triton\nfrom spec import LLM, SamplingParams\n"
            "from spec.engine import freeze_loaded_objects\n"
            f"llm = LLM({str(tiny_llama_dir)!r}, max_model_len=64, num_kv_blocks=8)\nfreeze_loaded_objects()\n"
            "print(llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("[")
    assert "nanobind" not in run.stderr, run.stderr[-2000:]
