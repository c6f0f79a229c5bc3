"""What this machine is, for the caches keyed by it and the line written beside every figure."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable, TypeVar

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


def cache_bytes(level: int) -> int:
    """The first CPU's cache of `level` (2: its L2, 3: the L3 it shares) in bytes, from sysfs;
    0 where the system does not say."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == str(level):
                size = (index / "size").read_text().strip()
                units = {"K": 1 << 10, "M": 1 << 20}
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return 0


T = TypeVar("T")


def cached_measurement(cache_dir: Path | None, prefix: str, key: dict, measure: Callable[[], T],
                       to_json: Callable[[T], dict], from_json: Callable[[dict], T], refresh: bool = False) -> T:
    """What `measure()` found on this machine for `key` (the machine's own key is added), read
    from `cache_dir/<prefix><digest>.json` when there, else (or with `refresh`) measured now and
    written there. A damaged file is measured again."""
    key = {**key, **machine_key()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"{prefix}{digest}.json" if cache_dir else None
    if path is not None and path.is_file() and not refresh:
        try:
            return from_json(json.loads(path.read_text())["timings"])
        except (ValueError, KeyError, TypeError):
            pass
    result = measure()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "timings": to_json(result)}, indent=1))
        tmp.replace(path)
    return result
