"""bench/gpu_check.sh's dry run (no CUDA): wheels carried in parts are joined, checked and
installed into a scratch folder, the GPU suite passes as skips, the training command runs on a
tiny model, and everything lands in the output folder. A part gone missing stops the run."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import MTBENCH_HEAD, ROOT, arithmetic_conversations

WHEEL = "tercel_probe-1.0-py3-none-any.whl"


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (module tercel_probe), made here: no package index needed."""
    path = folder / WHEEL
    files = {"tercel_probe/__init__.py": "VALUE = 7\n",
             "tercel_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tercel-probe\nVersion: 1.0\n",
             "tercel_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "tercel_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, "tercel_probe-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return path


def carry_in_parts(tmp_path: Path, drop_part: int | None = None) -> Path:
    """carry/wheels holding the probe wheel as two parts and its .sha256 (as the docstring of
    bench/gpu_check.sh splits the model's wheel), one part left out if `drop_part` says so."""
    wheels = tmp_path / "carry" / "wheels"
    wheels.mkdir(parents=True)
    blob = probe_wheel(tmp_path).read_bytes()
    (wheels / f"{WHEEL}.sha256").write_text(f"{hashlib.sha256(blob).hexdigest()}  {WHEEL}\n")
    half = len(blob) // 2
    for i, part in enumerate((blob[:half], blob[half:])):
        if i != drop_part:
            (wheels / f"{WHEEL}.part-{i:02d}").write_bytes(part)
    return wheels.parent


def run_check(tmp_path: Path, carry: Path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_CARRY": str(carry),
           "GPU_CHECK_STASH": str(tmp_path / "stash"), "TMPDIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def dry_data(tmp_path):
    """The shared data folder's layout, filled from tests: train/ with a dozen conversations and
    mtbench/ with the questions of tests/data."""
    data = tmp_path / "data"
    for folder in ("train", "mtbench"):
        (data / folder).mkdir(parents=True)
    rows = arithmetic_conversations(12)
    (data / "train" / "arithmetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(MTBENCH_HEAD, data / "mtbench" / "question.jsonl")
    return data


# The whole run under `make test-slow` (about 40 s: an install, the GPU suite's collection, a training run);
# the install's own check, below, stays in `make test`.
@pytest.mark.slow
def test_dry_run_installs_the_parts_skips_the_gpu_suite_and_trains(tmp_path, tiny_llama_dir, dry_data):
    train = "--limit-per-source 4 --regen-max-tokens 8 --max-tokens 300 --eval-prompts 2 --eval-tokens 8 " \
            "--regen-batch 4 --draft-vocab 4096 --max-len 200 --batch-tokens 1024"
    carry = carry_in_parts(tmp_path)
    carried = [{**r, "conversations": r["conversations"][:1] + [{"role": "assistant", "content": f"carried {r['id']}"}]}
               for r in arithmetic_conversations(12)]           # every reply regenerated already, on a CPU
    with gzip.open(carry / "regenerated.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in carried)
    done = run_check(tmp_path, carry, GPU_CHECK_DATA=str(dry_data),
                     GPU_CHECK_TARGET=str(tiny_llama_dir), GPU_CHECK_TRAIN_ARGS=train)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert done.returncode == 0, summary + done.stderr
    for stage in ("install", "env", "test-gpu", "train"):
        assert f"- {stage}: ok" in summary
    assert "dry run" in summary                                         # no CUDA: no benchmark
    assert "bandwidth" not in summary and "graph-steps" not in summary
    assert sorted(p.name for p in (tmp_path / "stash" / "wheels").iterdir()) == [WHEEL, f"{WHEEL}.sha256"]
    assert json.loads((tmp_path / "out" / "training_summary.json").read_text())["heldout"]["prompts"] == 2
    assert (tmp_path / "out" / "eagle3-head.tgz.part-00").is_file() and (tmp_path / "out" / "logs.tgz").is_file()
    with gzip.open(tmp_path / "out" / "regenerated.jsonl.gz", "rt") as f:   # trained on, none regenerated
        assert [json.loads(line) for line in f] == carried


def test_a_missing_part_stops_the_run_at_install(tmp_path):
    done = run_check(tmp_path, carry_in_parts(tmp_path, drop_part=1))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert done.returncode != 0
    assert "- install: FAILED" in summary and "parts missing or damaged" in summary
    assert "- test-gpu" not in summary and "- train" not in summary       # stopped at the first failure
