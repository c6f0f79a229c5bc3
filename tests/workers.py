"""`make test` on every CPU of its budget: pytest-xdist workers, as many as the CPUs and the free
memory allow, each running whole test files (`--dist loadfile`, so a module's fixtures are built
once). The files whose peak memory is largest run one after another on one worker, first, while
the workers' own resident memory is smallest: two of them side by side, late in the run, would
come to about 6.5 GB by their measured peaks, past the suite's 6 GB budget (docs/performance.md,
"Test suite")."""
from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# What one worker may hold at its peak: its own resident memory after a few hundred tests
# (about 2 GB) plus the largest module's (about 1.7 GB), with room to spare.
WORKER_MEMORY = 3 << 30

# Each about 1-1.7 GB above its worker's own memory at its peak (measured per module with
# /proc/self/clear_refs, docs/performance.md, "Test suite"); the others stay under 0.8 GB.
HEAVY_MODULES = frozenset({
    "tests/model/test_smollm2_vs_hf.py",          # SmolLM2 in HF transformers beside Tercel's
    "tests/training/test_training.py",            # the target's features and a head's optimizer
    "tests/model/test_quantized_model.py",
    "tests/serving/test_api_reasoning.py",        # dense fp32 SmolLM2 behind a server
    "tests/engine/test_reasoning_exactness.py",   # dense fp32 SmolLM2, every drafter
    "tests/drafters/test_eagle3.py",
    "tests/drafters/test_quantized_draft.py",     # dense fp32 SmolLM2 and its int4 self
})
HEAVY = "heavy modules"


def worker_count(cpus: int, memory: int | None) -> int:
    """One worker per CPU of the budget, as many as the free memory holds, at least one."""
    by_memory = cpus if memory is None else memory // WORKER_MEMORY
    return max(1, min(cpus, by_memory))


class HeavyFirst(LoadFileScheduling):
    """Whole files to whichever worker runs short, the heavy ones as a single unit handed out
    before any other."""

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return HEAVY if path in HEAVY_MODULES else path

    def _assign_work_unit(self, node) -> None:
        if HEAVY in self.workqueue:
            self.workqueue.move_to_end(HEAVY, last=False)
        super()._assign_work_unit(node)
