"""The fused CPU kernels of `csrc/decode_ops.c`, built on first use and called through ctypes.

The library is compiled for the machine it runs on (`cc -O3 -march=native`, under half a
second) into the Tercel cache, keyed by the source, the compiler and the CPU's flags, and
loaded after torch so that its OpenMP calls share torch's runtime (the same libgomp, the
same threads). Without a C compiler `available()` is False and the quantized target is not
offered (see `verifier.quantize`).

Every wrapper takes contiguous CPU tensors of the dtypes its comment names; bf16 data is
passed as its bit pattern.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from verifier.kernels import machine_key
from verifier.loader import cache_root

log = logging.getLogger("tercel.cpu_ops")
SOURCE = Path(__file__).parent / "csrc" / "decode_ops.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "rms_norm_rows": [_P, _P, _P, _F, _I, _I, _P],
    "silu_mul": [_P, _I, _I, _P],
    "rope_store": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    "attend": [_P, _P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _F, _P],
}
_lib: ctypes.CDLL | None = None
_tried = False


def available() -> bool:
    return _library() is not None


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _load(_build())
        except (OSError, subprocess.CalledProcessError, FileNotFoundError) as e:
            log.warning("the fused CPU kernels could not be built (%s); quantized CPU weights are off", e)
    return _lib


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()
                         + machine_key()["flags"].encode()).hexdigest()[:16]
    out = cache_root() / "cpu_kernels" / f"decode_ops-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True)
        tmp.replace(out)
    return out


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None) -> None:
    """x fp32 [T, H] += y (bf16 [T, H], or None); out bf16 [T, H] = rms_norm(x) * w (None: skip)."""
    rows, h = x.shape
    _library().add_rms_norm(x.data_ptr(), _ptr(y), w.data_ptr(), eps, rows, h, _ptr(out))


def rms_norm_rows(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 rms_norm(x[rows]) * w: x fp32 [T, H], rows int64 [N] -> [N, H]."""
    out = torch.empty(rows.shape[0], x.shape[1])
    _library().rms_norm_rows(x.data_ptr(), rows.data_ptr(), w.data_ptr(), eps, rows.shape[0], x.shape[1],
                             out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """out bf16 [T, I] = silu(gate) * up for gu bf16 [T, 2I] = [gate | up]."""
    rows, inter = out.shape
    _library().silu_mul(gu.data_ptr(), rows, inter, out.data_ptr())


def rope_store(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin_signed: torch.Tensor,
               positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               q: torch.Tensor) -> None:
    """q fp32 [T, NH, D] = rope(q heads of qkv); k (rotated) and v heads written into the fp32
    caches [.., NKV, D] at `slots` (int64 [T]). qkv bf16 [T, (NH + 2 NKV) D] (+ bias fp32);
    `positions` int64 [T] index the rope tables fp32 [P, D] (sin with its sign folded in)."""
    rows, nh, d = q.shape
    _library().rope_store(qkv.data_ptr(), _ptr(bias), cos.data_ptr(), sin_signed.data_ptr(), positions.data_ptr(),
                          slots.data_ptr(), rows, nh, k_cache.shape[-2], d, q.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr())


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, block_size: int, scale: float,
           out: torch.Tensor) -> None:
    """out bf16 [T, NH * D] = attention of q fp32 [T, NH, D] over the fp32 caches; `plan` (a
    RowPlan) describes the sequences."""
    rows, nh, d = q.shape
    _library().attend(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), plan.num_seqs, plan.row0.data_ptr(),
                      plan.num_new.data_ptr(), plan.ctx.data_ptr(), plan.table0.data_ptr(), plan.tables.data_ptr(),
                      plan.mask0.data_ptr(), plan.masks.data_ptr(), block_size, nh, k_cache.shape[-2], d, scale,
                      out.data_ptr())
