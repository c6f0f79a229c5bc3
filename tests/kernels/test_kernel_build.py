"""The fused CPU kernels build wherever a C compiler is found: their own tests skip where
there is none, so a source that does not compile must fail here rather than skip them all. The
cache's folder builds (converted models, tokenizers) are whole or absent, whoever builds them."""
from __future__ import annotations

import os
import shutil

import pytest

from verifier.cpu import cpu_ops
from verifier.cpu.cache import build_once


def test_the_kernels_build_where_a_compiler_is_found():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the kernels' tests skip, and the quantized target is not offered")
    assert cpu_ops.available(), f"a C compiler is here but the kernels did not build:\n{cpu_ops.build_error()}"


def test_a_build_keeps_the_folder_another_process_put_in_place_first(tmp_path):
    """Two processes converting one file at once (two servers, two test workers): the later one
    keeps the first one's folder, which that process may be loading from, and drops its own."""
    out = tmp_path / "model"

    def build_beside_another(tmp):
        (tmp / "config.json").parent.mkdir(parents=True)
        (tmp / "config.json").write_text("mine")
        out.mkdir()                                   # the other process finished meanwhile
        (out / "config.json").write_text("theirs")

    assert build_once(out, build_beside_another) == out
    assert (out / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]      # no temporary folder left


def test_a_failed_build_leaves_nothing(tmp_path):
    def fail(tmp):
        tmp.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_once(tmp_path / "model", fail)
    assert list(tmp_path.iterdir()) == []
