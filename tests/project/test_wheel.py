"""The built wheel carries every file the packages read besides their modules: the C/C++
kernel sources and headers (compiled on first use) and the bench data. A wheel without
them installs, imports, and then cannot build the quantized path."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("spec", "drafters", "verifier", "tree", "serving", "training", "bench")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *PACKAGES, "pyproject.toml", "README.md"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_wheel_holds_every_source_and_data_file_of_the_packages(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"
    files = _tracked()
    for f in files:                          # a copy of the tracked tree: no build/ or egg-info left in the checkout
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    build = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    name = subprocess.run([sys.executable, "-c", build, str(dist)], cwd=src, capture_output=True, text=True,
                          check=True).stdout.split()[-1]
    inside = set(zipfile.ZipFile(dist / name).namelist())
    wanted = {f for f in files if f.split("/")[0] in PACKAGES and not f.endswith(".py")}
    assert wanted and {"verifier/cpu/csrc/bf16.h", "bench/data/structured_tasks.jsonl"} <= wanted
    assert wanted - inside == set()
    assert {f for f in files if f.endswith(".py") and f.split("/")[0] in PACKAGES} - inside == set()
