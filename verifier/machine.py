"""What this machine is, for the caches keyed by it and the line written beside every figure."""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch


def _cpuinfo() -> dict[str, str]:
    """The first CPU's entries of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            info.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return info


def machine_key() -> dict:
    """What makes timings from one machine invalid on another."""
    info = _cpuinfo()
    return {"cpu": info.get("model name", platform.processor()),
            "flags": hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def machine_summary() -> str:
    """CPU model, its vector extensions, torch and threads: the line to write beside a figure."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
             if f in flags]
    return (f"{info.get('model name', platform.processor())} ({' '.join(shown) or 'no AVX2'}), "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")
