"""The fused CPU kernels build wherever a C compiler is found: their own tests skip where
there is none, so a source that does not compile must fail here rather than skip them all."""
from __future__ import annotations

import os
import shutil

import pytest

from verifier.cpu import cpu_ops


def test_the_kernels_build_where_a_compiler_is_found():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the kernels' tests skip, and the quantized target is not offered")
    assert cpu_ops.available(), f"a C compiler is here but the kernels did not build:\n{cpu_ops.build_error()}"
