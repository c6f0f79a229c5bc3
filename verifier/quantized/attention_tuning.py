"""From how much work a forward's attention runs on all threads: measured on this machine, once.

The fused attention (`csrc/decode_ops.c:attend`) spreads its work items (chunks of keys of a
KV head's query vectors) over the threads; a small forward runs on the calling thread alone,
because an OpenMP region costs a few microseconds and a single decode row at a short context
has only a few items (3 for SmolLM2's 3 KV heads) to share. Where spreading starts to pay
depends on the machine (cores, SMT, vector width, caches, how busy it is) and on the model's
heads, so it is timed at load: one row and a 4-row unit at 32 to 2048 keys, on one thread and
on all, alternated; `parallel_from` is the smallest work (rows x keys x query heads) from
which all threads win at that size and every larger one (the sizes are timed from the most
work down, up to the first that all threads do not win; a size whose first round is clear-cut
takes no more). The choice never changes a row's
bits: the chunks and the order they merge in are the same either way.

Each call is timed as a decode step makes it: its KV cold (a step's weights stream through
the caches between one layer's attention and the next step's), requested by `prefetch_kv`
just before. Timed hot, back to back, one thread won at every size on a machine where all
threads won inside the step (docs/quantization.md, "Attention").

Cached per (CPU model and flags, torch version, threads, heads, kernel source) under the Tercel cache folder,
beside the matmul timings, when measured quiet (`verifier.cpu.machine.cached_measurement`: beside
a busy neighbour the all-threads calls wait for a descheduled partner, and one thread would win
everywhere); `tercel bench kernels` prints the table.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verifier.batch import SeqInput
from verifier.cpu import cpu_ops
from verifier.cpu.machine import cache_bytes, cached_measurement
from verifier.quantized.cpu_forward import row_plan

FORMAT = 6                   # 6: a loss takes every round (5: KV flushed line by line; 4: the
                             # evictor capped; 3: KV prefetched during a stand-in qkv matmul)
KEYS = (32, 64, 128, 256, 512, 1024, 2048)
ROWS = (1, 4)
NEVER = 1 << 62              # parallel_from when one thread always won
MARGIN = 0.95                # all threads win where they take under 95% of one thread's time
DECISIVE = 0.8               # a size whose every call shows a win by this much needs no more rounds
_BLOCK = 16


@dataclass(frozen=True)
class AttentionTimings:
    """Microseconds per attention call on one thread and on all, per (rows, keys), and the
    threshold chosen from them."""
    serial: dict[tuple[int, int], float]
    parallel: dict[tuple[int, int], float]
    parallel_from: int

    def to_json(self) -> dict:
        return {"cells": [[r, k, self.serial[r, k], self.parallel[r, k]] for r, k in self.serial],
                "parallel_from": self.parallel_from}

    @classmethod
    def from_json(cls, d: dict) -> "AttentionTimings":
        cells = {(r, k): (s, p) for r, k, s, p in d["cells"]}
        return cls({c: v[0] for c, v in cells.items()}, {c: v[1] for c, v in cells.items()}, d["parallel_from"])


def choose(serial: dict[tuple[int, int], float], parallel: dict[tuple[int, int], float], heads: int) -> int:
    """The smallest work (rows x keys x heads) from which all threads win at every larger
    measured size too; NEVER if the largest size is not won. A win is by MARGIN: where the two
    are within timing noise (small sizes), one thread leaves the other free."""
    best = NEVER
    for rows, keys in _by_work_down(serial):
        if parallel[rows, keys] >= MARGIN * serial[rows, keys]:
            break
        best = rows * keys * heads
    return best


def _caches(hd: cpu_ops.Heads, gen: torch.Generator) -> list[torch.Tensor]:
    """Two sets of random k and v caches for the most keys timed; each case reads their first
    blocks (drawn once: drawing them per case took half the timing's time for 32 KV heads)."""
    return [torch.randn(-(-max(KEYS) // _BLOCK) * _BLOCK, hd.nkv, hd.d, generator=gen).bfloat16() for _ in range(4)]


def _case(hd: cpu_ops.Heads, rows: int, keys: int, gen: torch.Generator, caches: list[torch.Tensor]):
    """Random q and the caches' first blocks for one sequence of `rows` new rows after `keys` -
    rows cached ones: the second set warms everything but the first's KV (see _cold_call)."""
    blocks = -(-keys // _BLOCK)
    seq = SeqInput([0] * rows, keys - rows, list(range(blocks)))
    plan = row_plan([seq], _BLOCK, hd.nh // hd.nkv)
    kv = [c[:blocks * _BLOCK] for c in caches]
    q = torch.randn(rows, hd.nh, hd.d, generator=gen)
    return plan, q, kv[:2], kv[2:], torch.empty(rows, hd.nh * hd.d, dtype=torch.bfloat16)


EVICT_MAX = 128 << 20       # a server CPU's shared L3 outgrows what a small model's step streams


def _evictor() -> torch.Tensor | None:
    """None where this build flushes cache lines itself (x86-64). Elsewhere a buffer twice the
    last-level cache, at least 32 MiB and at most EVICT_MAX: reading it pushes the caches' lines
    out, as a step's weights do. Capped because a VM on a server CPU sees its whole shared L3,
    which made the buffer a gigabyte read a thousand times per load (docs/performance.md,
    "Models of real sizes"), where a small model's weights leave its KV in that L3 between
    steps anyway."""
    if cpu_ops.can_flush():
        return None
    return torch.ones(min(max(2 * cache_bytes(3), 32 << 20), EVICT_MAX) // 4)


def _cold_call(hd: cpu_ops.Heads, case, stand_in: torch.Tensor, evict: torch.Tensor | None) -> float:
    """Microseconds of one attend call as a decode step makes it: the KV set and `stand_in`
    pushed out of the caches (flushed line by line, or by reading `evict`), a call over the
    second KV set brings back the code, the plan, q and the output (hot in a step: the layer
    before used them), then prefetch_kv requests the first KV set and `stand_in` is read, as
    the layer's qkv matmul streams its int4 weights (all threads reading: the KV lines arrive
    meanwhile and the threads are awake, as in a step), and the timed call reads that KV set."""
    plan, q, (k, v), warm, out = case
    if evict is None:
        for t in (k, v, stand_in):
            cpu_ops.flush(t)
    else:
        evict.sum()
    cpu_ops.attend(hd, plan, q, *warm, out)
    cpu_ops.prefetch_kv(hd, plan, k, v)
    stand_in.sum()
    start = time.perf_counter()
    cpu_ops.attend(hd, plan, q, k, v, out)
    return (time.perf_counter() - start) * 1e6


def _warm_call(hd: cpu_ops.Heads, case) -> None:
    """One call to bring the code in and wake the threads after a change of mode: its KV need
    not be cold."""
    plan, q, (k, v), _, out = case
    cpu_ops.attend(hd, plan, q, k, v, out)


def _qkv_words(hd: cpu_ops.Heads) -> int:
    """fp32 words as many bytes as a layer's qkv weights in int4 (hidden size taken as nh x d)."""
    return hd.nh * hd.d * (hd.nh + 2 * hd.nkv) * hd.d // 8


def measure(hd: cpu_ops.Heads, rounds: int = 3, calls: int = 3) -> AttentionTimings:
    """Time attend on one thread and on all, alternated per round, each call cold; medians.
    Sizes run from the most work down and stop after the first that all threads do not win
    (`choose` reads no smaller one); a size takes rounds until `_decided`. Leaves
    hd.parallel_from as it found it."""
    gen, saved, evict = torch.Generator().manual_seed(0), hd.parallel_from, _evictor()
    stand_in, caches = torch.ones(_qkv_words(hd)), _caches(hd, gen)
    med: dict[str, dict[tuple[int, int], float]] = {"serial": {}, "parallel": {}}
    try:
        for rows, keys in _by_work_down():
            case = _case(hd, rows, keys, gen, caches)
            samples: dict[str, list[float]] = {"serial": [], "parallel": []}
            for _ in range(rounds):
                for mode, threshold in (("serial", NEVER), ("parallel", 0)):
                    hd.parallel_from = threshold
                    _warm_call(hd, case)
                    samples[mode] += [_cold_call(hd, case, stand_in, evict) for _ in range(calls)]
                if _decided(samples["serial"], samples["parallel"]):
                    break
            for mode, times in samples.items():
                med[mode][rows, keys] = round(statistics.median(times), 2)
            if med["parallel"][rows, keys] >= MARGIN * med["serial"][rows, keys]:
                break
    finally:
        hd.parallel_from = saved
    return AttentionTimings(med["serial"], med["parallel"], choose(med["serial"], med["parallel"], hd.nh))


def _decided(serial: list[float], parallel: list[float]) -> bool:
    """Whether a size's verdict is in already: every all-threads call under DECISIVE times every
    one-thread call, so that its median sits far from MARGIN's line and more rounds (each a few
    ms at long contexts) would not move it there. A loss always takes every round: a stall of
    the host can fill one round's calls of one mode, and a loss ends the descent."""
    return max(parallel) < DECISIVE * min(serial)


def _by_work_down(cells=None) -> list[tuple[int, int]]:
    """(rows, keys) cells (default: every one timed) in `choose`'s order: the most work first."""
    cells = [(r, k) for r in ROWS for k in KEYS] if cells is None else cells
    return sorted(cells, key=lambda c: (c[0] * c[1], c), reverse=True)


def _untrusted(timings: AttentionTimings) -> AttentionTimings:
    """Timings taken beside a busy neighbour, which make one thread look faster at every size:
    the default threshold instead, or a server loaded at a busy moment would keep long contexts'
    attention on one thread for its whole life (the governor gives it one thread while crowded)."""
    return AttentionTimings(timings.serial, timings.parallel, cpu_ops.PARALLEL_FROM)


def tune(hd: cpu_ops.Heads, cache_dir: Path | None, refresh: bool = False,
         threads: int | None = None) -> AttentionTimings:
    """This machine's cached timings for these heads, else (or with `refresh`) new ones, which
    are cached; sets hd.parallel_from from them."""
    kernels = cpu_ops.sources_digest([cpu_ops.DECODE_OPS])   # a new kernel is timed anew
    key = {"format": FORMAT, "heads": [hd.nh, hd.nkv, hd.d], "kernels": kernels}
    timings = cached_measurement(cache_dir, "attention-", key, lambda: measure(hd), AttentionTimings.to_json,
                                 AttentionTimings.from_json, refresh, threads, crowded=_untrusted)
    hd.parallel_from = timings.parallel_from
    return timings
