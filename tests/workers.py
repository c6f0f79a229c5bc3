"""`make test` on every CPU of its budget: pytest-xdist workers, one test file each at a time
(`--dist loadfile`, so a module's fixtures are built once), as many as the CPUs and the free
memory allow; the modules marked `heavy_memory` run while no other module does
(docs/performance.md, "Test suite")."""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

# What one worker may hold at its peak: the process's own resident memory after a few hundred
# tests (about 2 GB) plus the largest module's (about 1.7 GB), with room to spare.
WORKER_MEMORY = 3 << 30


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux); None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def worker_count(cpus: int, memory: int | None) -> int:
    """One worker per CPU of the budget, as many as the free memory holds, at least one."""
    by_memory = cpus if memory is None else memory // WORKER_MEMORY
    return max(1, min(cpus, by_memory))


@contextlib.contextmanager
def module_turn(run_id: str, alone: bool):
    """Held while a module runs: shared by the light modules, whole for a heavy one. A heavy
    module first takes the turnstile and keeps it while it waits, so that light modules cannot
    keep coming in ahead of it."""
    folder = Path(tempfile.gettempdir())
    with open(folder / f"tercel-tests-{run_id}.turnstile", "a") as turnstile, \
            open(folder / f"tercel-tests-{run_id}.modules", "a") as modules:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(modules, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(modules, fcntl.LOCK_UN)
