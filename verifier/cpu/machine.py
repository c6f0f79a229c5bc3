"""What this machine is, for the caches keyed by it and the line written beside every figure.

`TERCEL_CPU_ISA=avx2` runs an AVX-512 machine as an AVX2-only one: Tercel's kernels are built
for Haswell (`-march=haswell`, the AVX2 machines' common set), torch's kernels dispatch as on
AVX2 (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`; set here, before torch's first kernel
reads them), and the flags that key caches and head figures are the ones the cap leaves. It
is how the AVX2 paths are checked and measured where no AVX2-only machine is at hand; the
microarchitecture (caches, memory) stays this machine's, and figures say so.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

import torch

from verifier.cpu.cpus import NeighbourMeter, cpu_budget

log = logging.getLogger("tercel.machine")

_ISA_CAPS = {"avx2": {"march": "haswell", "aten": "avx2", "onednn": "AVX2",
                      "drop": ("avx512", "amx", "avx_vnni")}}


def isa_cap() -> str | None:
    """The instruction set Tercel is held to (`TERCEL_CPU_ISA`), or None for all this CPU has."""
    cap = os.environ.get("TERCEL_CPU_ISA", "").strip().lower() or None
    if cap is not None and cap not in _ISA_CAPS:
        raise ValueError(f"TERCEL_CPU_ISA={cap!r}: the caps known are {sorted(_ISA_CAPS)}")
    return cap


def march() -> str:
    """The `-march` Tercel's C kernels are built for."""
    cap = isa_cap()
    return _ISA_CAPS[cap]["march"] if cap else "native"


def _cap_torch() -> None:
    cap = isa_cap()
    if cap:     # torch reads these at its first CPU kernel, not at import
        os.environ.setdefault("ATEN_CPU_CAPABILITY", _ISA_CAPS[cap]["aten"])
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ISA_CAPS[cap]["onednn"])


_cap_torch()


def cpu_flags() -> list[str]:
    """This CPU's flags as Tercel may use them: those above the ISA cap are left out."""
    flags = _cpuinfo().get("flags", "").split()
    cap = isa_cap()
    if cap:
        flags = [f for f in flags if not f.startswith(_ISA_CAPS[cap]["drop"])]
    return flags


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


def machine_key(threads: int | None = None) -> dict:
    """What makes timings from one machine invalid on another (`threads`: the count they are
    for; None: this thread's torch count)."""
    info = _cpuinfo()
    return {"cpu": info.get("model name", platform.processor()),
            "flags": hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": threads or torch.get_num_threads()}


def default_threads() -> int:
    """The threads an engine runs on unless configured: the CPU budget (affinity and quota), or
    torch's count where the caller set it lower (OMP_NUM_THREADS, torch.set_num_threads)."""
    return min(cpu_budget().threads, torch.get_num_threads())


@contextmanager
def on_threads(n: int | None) -> Iterator[None]:
    """torch work inside on `n` threads (None: as it is), the caller's count set back after. The
    count is the calling thread's OpenMP team; the C kernels read it per call."""
    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def machine_summary() -> str:
    """CPU model, its vector extensions, torch and threads: the line to write beside a figure."""
    info = _cpuinfo()
    flags = set(cpu_flags())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
             if f in flags]
    cap = f", capped at {isa_cap().upper()} by TERCEL_CPU_ISA" if isa_cap() else ""
    return (f"{info.get('model name', platform.processor())} ({' '.join(shown) or 'no AVX2'}{cap}), "
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


# Timings cached for good must come from a quiet machine: a neighbour busy during them (another
# engine loading, a test suite) makes every parallel path look slow, and the choice would stick.
CACHE_FORMAT = 2            # 2: written only when measured quiet (1: entries that may not have been)
QUIET_CPUS = 0.25           # CPUs other processes may keep busy, beyond those the measurement left idle
QUIET_WINDOW = 0.25         # seconds: below this /proc/stat's 10 ms ticks blur the reading


def _neighbour_meter():
    """A `verifier.cpu.cpus.NeighbourMeter`: called, the CPUs other processes kept busy since
    the last call; `.cpus`, the CPUs it covers."""
    return NeighbourMeter()


def _crowded(others: float | None, cpus: int, threads: int) -> bool:
    """Whether other processes took CPUs the measurement's threads needed: more than the CPUs
    it left idle (a big shared host's other tenants do not count) plus QUIET_CPUS."""
    return others is not None and others > max(0, cpus - threads) + QUIET_CPUS


def _cached_path(cache_dir: Path | None, prefix: str, key: dict, threads: int | None) -> tuple[dict, Path | None]:
    """(the key with the machine's, the file it is cached in: None without a cache folder)."""
    key = {**key, **machine_key(threads), "cache_format": CACHE_FORMAT}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return key, cache_dir / f"{prefix}{digest}.json" if cache_dir else None


def _read(path: Path | None, from_json: Callable[[dict], T]) -> T | None:
    if path is None or not path.is_file():
        return None
    try:
        return from_json(json.loads(path.read_text())["timings"])
    except (ValueError, KeyError, TypeError):
        return None                     # a damaged file: measured again


def cached_only(cache_dir: Path | None, prefix: str, key: dict, from_json: Callable[[dict], T],
                threads: int | None = None) -> T | None:
    """What `cached_measurement` keeps for `key` on this machine, or None (nothing measured and
    kept quiet yet): a lookup that never measures."""
    return _read(_cached_path(cache_dir, prefix, key, threads)[1], from_json)


def cached_measurement(cache_dir: Path | None, prefix: str, key: dict, measure: Callable[[], T],
                       to_json: Callable[[T], dict], from_json: Callable[[dict], T], refresh: bool = False,
                       threads: int | None = None, crowded: Callable[[T], T] | None = None) -> T:
    """What `measure()` found on this machine for `key` (the machine's own key is added), read
    from `cache_dir/<prefix><digest>.json` when there, else (or with `refresh`) measured now, on
    `threads` (None: the current count), and written there if no other process took CPUs its
    threads needed meanwhile (`_neighbour_meter`, `_crowded`): timings taken beside other work
    serve this load only, as they are or as `crowded(timings)` makes them (a choice that does not
    trust them), and the next load measures again. A damaged file is measured again."""
    key, path = _cached_path(cache_dir, prefix, key, threads)
    if not refresh and (known := _read(path, from_json)) is not None:
        return known
    meter, start = _neighbour_meter(), time.monotonic()
    with on_threads(threads):
        result = measure()
    others = meter() if time.monotonic() - start >= QUIET_WINDOW else None
    if _crowded(others, meter.cpus, key["threads"]):
        log.warning("%s timings taken while other processes kept %.2f CPUs busy: not cached (the next "
                    "load measures again)", prefix.rstrip("-") or "kernel", others)
        return crowded(result) if crowded else result
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "timings": to_json(result)}, indent=1))
        tmp.replace(path)
    return result
