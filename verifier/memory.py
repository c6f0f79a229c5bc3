"""What a loaded target holds in memory, and whether a model will fit before it is loaded.

`MemoryReport` is what the engine prints at start and `/metrics` serves (`tercel_memory_bytes`):
the weights as the runner holds them (packed layouts for the quantized runner, dense tensors
otherwise), the embedding and LM head tables, the KV pool (reserved: a CPU pool's pages are
committed only as they are written), and the process's resident bytes after the load, which
also counts the interpreter, torch, the tokenizer and scratch. `check_fits` refuses a model
whose weights exceed the memory available, before any is read, with the numbers: the machine's,
or in a container the limit of its cgroup less what it already holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verifier.cpu.cpus import ProcFiles, controller_dirs

GB = 1e9


def _field(path: Path | str, name: str) -> int | None:
    """The number after `name` in a `name[:] value ...` file (/proc/meminfo, a cgroup's memory.stat)."""
    try:
        for line in Path(path).read_text().splitlines():
            key, *values = line.split()
            if key.rstrip(":") == name and values:
                return int(values[0])
    except (OSError, ValueError):
        pass
    return None


def _meminfo(field: str, path: str) -> int | None:
    kib = _field(path, field)
    return None if kib is None else kib * 1024


def available_bytes(files: ProcFiles = ProcFiles()) -> int | None:
    """The memory that can be given out now without swapping or the OOM killer: the kernel's
    MemAvailable, or less where a cgroup's limit (a container's) leaves less (None: unknown)."""
    found = [b for b in (_meminfo("MemAvailable", "/proc/meminfo"), cgroup_headroom(files)) if b is not None]
    return min(found, default=None)


def cgroup_headroom(files: ProcFiles = ProcFiles()) -> int | None:
    """The least that the memory limits on the path from this process's cgroup to the root leave
    it; None where none is set or the files cannot be read. A container sees its host's
    MemAvailable, but the OOM killer holds it to its own limit."""
    try:
        cgroups, mounts = files.cgroup.read_text(), files.mountinfo.read_text()
    except OSError:
        return None
    left = [h for d in controller_dirs(cgroups, mounts, files.root, "memory") if (h := _dir_headroom(d)) is not None]
    return min(left, default=None)


# cgroup v2's files, then v1's; v1 writes "no limit" as 2^63 rounded down to a page.
_LIMIT_FILES = (("memory.max", "memory.current", "inactive_file"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
_NO_LIMIT = 1 << 62


def _dir_headroom(d: Path) -> int | None:
    """This cgroup directory's limit less its working set (usage less the inactive page cache,
    which the kernel reclaims before it kills: a GGUF read once stays cached), or None."""
    for limit_file, usage_file, inactive in _LIMIT_FILES:
        try:
            limit = (d / limit_file).read_text().strip()
            usage = int((d / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= _NO_LIMIT:
            return None
        return max(0, int(limit) - usage + (_field(d / "memory.stat", inactive) or 0))
    return None


def resident_bytes() -> int | None:
    """This process's resident set (None: unknown)."""
    return _meminfo("VmRSS", "/proc/self/status")


@dataclass(frozen=True)
class MemoryReport:
    weights: int            # the decoder's projections as held (packed, or dense)
    tables: int             # the embedding and the LM head (with its scan, where quantized)
    other: int              # norms, biases, rotary tables
    kv_pool: int            # reserved for the KV cache
    resident: int | None    # the process's resident bytes when measured

    def parts(self) -> dict[str, int]:
        """By the name `/metrics` labels them with."""
        out = {"weights": self.weights, "tables": self.tables, "other": self.other, "kv_pool": self.kv_pool}
        return out if self.resident is None else {**out, "resident": self.resident}

    def line(self) -> str:
        held = (f"memory: weights {self.weights / GB:.2f} GB, embedding and head {self.tables / GB:.2f} GB, "
                f"other {self.other / GB:.3f} GB, KV pool {self.kv_pool / GB:.2f} GB reserved")
        return held + ("" if self.resident is None else f"; resident now {self.resident / GB:.2f} GB")


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors` (tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and not t.is_meta:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def check_fits(what: str, needed: int, available: int | None = None) -> None:
    """ValueError naming both figures where `needed` bytes exceed the memory available."""
    available = available_bytes() if available is None else available
    if available is not None and needed > available:
        raise ValueError(f"{what} needs about {needed / GB:.2f} GB of memory and this machine has "
                         f"{available / GB:.2f} GB available: it will not fit")
