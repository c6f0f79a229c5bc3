"""What a loaded target holds in memory, and whether a model will fit before it is loaded.

`MemoryReport` is what the engine prints at start and `/metrics` serves (`tercel_memory_bytes`):
the weights as the runner holds them (packed layouts for the quantized runner, dense tensors
otherwise), the embedding and LM head tables, the KV pool (reserved: a CPU pool's pages are
committed only as they are written), and the process's resident bytes after the load, which
also counts the interpreter, torch, the tokenizer and scratch. `check_fits` refuses a model
whose weights exceed the memory the machine has available, before any is read, with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 1e9


def _meminfo(field: str, path: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024          # kB
    except OSError:
        pass
    return None


def available_bytes() -> int | None:
    """The memory the kernel reckons can be given out now without swapping (None: unknown)."""
    return _meminfo("MemAvailable", "/proc/meminfo")


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
