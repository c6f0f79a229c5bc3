"""Choose the CPU matmul kernel of a quantized model by measuring the weights' own kernels on this
machine, once.

Every row (decode steps, tree nodes, prompt rows) takes one of the weight's own kernels (torch's
int4 or Tercel's q4x16 for int4 weights, torch's int8 or q8x16 for int8 ones), whose rows are
bitwise the same whatever else shares the call: a prompt prefilled alone or inside a batch, in
one chunk or after a prefix-cache hit, leaves the same KV cache, and a decode row the same
logits. No dense copy of a weight is kept for prompt rows (a 1.7B model's would take several
times its file's memory). Which kernel is fastest differs between machines (the q4x16 kernel's
integer dot products are one instruction with AVX-512 VNNI and three with AVX2), so the kernels
are timed at the row counts the engine uses, over one layer's weights, and the one with the
lowest total over 1 to 8 rows (decode steps and verify trees) is kept, if a probe at load finds
its rows invariant. Timings are cached per (CPU model and flags, torch version, threads, weight
shapes, row counts) under the Tercel cache folder; `tercel bench kernels` prints them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from verifier.cpu.machine import cached_measurement, cached_only
from verifier.quantized.qlinear import QuantLinear

FORMAT = 10          # 10: the fastest of rounds over the whole table (9: only the choices probed, fastest first)
# A path that took over SKIP_MS and SKIP_FACTOR times the best at one count is not timed at
# larger counts (at prompt-sized counts an int4 kernel is several times slower than oneDNN, and
# timing it would add seconds to a load; figures: docs/performance.md, "Matmul paths and
# quantized kernels").
SKIP_FACTOR, SKIP_MS = 3.0, 100.0
CLIFF = 1.4          # see KernelTimings.rows_before_cliff
PROBE_OUTPUTS = 1 << 16     # outputs of each shape the row-invariance probe compares, at least
SAMPLED_ROWS = 8       # the own kernel is chosen on its total over 1 to this many rows
CHOICE_ROWS = tuple(range(1, SAMPLED_ROWS + 1))     # what a load times: the counts the choice reads


@dataclass(frozen=True)
class KernelPlan:
    """Every row takes the own kernel `own` ("": the weight's kind) where the weight offers it."""
    own: str = ""


@dataclass(frozen=True)
class KernelTimings:
    """Milliseconds for one layer's matmuls, per own kernel and row count (None: not timed,
    already far behind at a smaller count), and whether each probed kernel passed the
    row-invariance probe (a kernel not probed has no entry)."""
    rows: tuple[int, ...]
    ms: dict[str, dict[int, float | None]]
    invariant: dict[str, bool]

    def rows_before_cliff(self, path: str, jump: float = CLIFF) -> int | None:
        """The largest row count before `path`'s first cost cliff (a step of one row after
        which every count up to SAMPLED_ROWS costs `jump` times more), or None without one.
        torch's int4 kernel works in blocks of 4 rows: past 4 rows its cost jumps, on AVX-512
        and AVX2 machines alike (figures: docs/performance.md, "Matmul paths and quantized
        kernels"), so a verify step of 4 rows is much cheaper than one of 5. A count alone that
        timed high (a noisy host) is no cliff."""
        t = self.ms.get(path, {})
        for r in self.rows:
            later = [t.get(m) for m in self.rows if r <= m <= SAMPLED_ROWS]
            if r - 1 in t and t[r - 1] and later and None not in later and min(later) > jump * t[r - 1]:
                return r - 1
        return None

    def sampled_ms(self, path: str) -> float | None:
        """The total over 1 to SAMPLED_ROWS rows (None: a count not timed)."""
        t = [self.ms.get(path, {}).get(m) for m in self.rows if m <= SAMPLED_ROWS]
        return None if not t or None in t else sum(t)

    def plan(self, owns: tuple[str, ...]) -> KernelPlan:
        """The own kernel among `owns` (the weights' row-invariant kernels) with the lowest
        `sampled_ms` that passed the probe (the first one without timings)."""
        timed = {p: c for p in owns if self.invariant.get(p) and (c := self.sampled_ms(p)) is not None}
        return KernelPlan(min(timed, key=timed.get, default=owns[0]))

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "ms": {p: {str(m): t for m, t in v.items()} for p, v in self.ms.items()},
                "invariant": self.invariant}

    @classmethod
    def from_json(cls, d: dict) -> "KernelTimings":
        return cls(tuple(d["rows"]), {p: {int(m): t for m, t in v.items()} for p, v in d["ms"].items()},
                   d["invariant"])


def choosable_owns(linears: list[QuantLinear]) -> tuple[str, ...]:
    """The own kernels the plan chooses among: those of the linears that offer a choice (int4
    weights: torch's or q4x16; the head's scan last), else the first linear's. A model whose file
    mixes formats (a Q4_K_M) has linears with one own kernel beside them (q4k, q8x16), which keep it."""
    return next((lin.own_paths() for lin in linears if len(lin.own_paths()) > 1), linears[0].own_paths())


def row_invariant(lins: list[QuantLinear], path: str, counts: tuple[int, ...] = (1, 3, 8, 33),
                  seeds: int = 4) -> bool:
    """Every probed row count gives each row the bits it has in a larger call, on one linear of
    each shape (a kernel splits its work by shapes, never by values), over up to `seeds` inputs:
    as many as compare PROBE_OUTPUTS outputs of the shape (`probe_seeds`)."""
    distinct = {(lin.kind, lin.out_features, lin.in_features, lin.bits): lin for lin in lins}
    return all(_rows_match(lin, path, counts, seed) for lin in distinct.values()
               for seed in range(probe_seeds(lin.out_features, counts, seeds)))


def probe_seeds(outputs: int, counts: tuple[int, ...], most: int) -> int:
    """Inputs enough to compare PROBE_OUTPUTS outputs (at least one, at most `most`): a sum run in
    another order shows after bf16 rounding in a share of the outputs, not a share of the inputs,
    so a 1.7B model's shapes compare that many on one input where a test's tiny ones take four
    (four 64-row inputs were half a first load's matmul timing there)."""
    return max(1, min(most, -(-PROBE_OUTPUTS // (outputs * sum(counts)))))


@torch.inference_mode()
def _rows_match(lin: QuantLinear, path: str, counts: tuple[int, ...], seed: int) -> bool:
    """The first m rows of a 64-row call equal an m-row call, for each m of `counts`: a path
    whose sums run in another order for m rows shows it only now and then after bf16 rounding,
    hence several seeds."""
    x = torch.randn(64, lin.in_features, generator=torch.Generator().manual_seed(seed))
    full = lin.run(path, x)
    return all(torch.equal(lin.run(path, x[:m]), full[:m]) for m in counts)


def engine_rows(prefill_chunk: int) -> tuple[int, ...]:
    """Row counts worth showing (`tercel bench kernels`): 1 to 8 (decode steps and verify trees;
    torch's int4 kernel changes cost every 4 rows), then powers of two up to the prefill chunk,
    and the chunk."""
    rows = set(range(1, 9)) | {prefill_chunk} | {1 << i for i in range(prefill_chunk.bit_length())}
    return tuple(sorted(r for r in rows if r <= prefill_chunk))


def time_paths(linears: list[QuantLinear], rows: tuple[int, ...], repeats: int = 3,
               probe: list[QuantLinear] | None = None, choices: tuple[str, ...] | None = None) -> KernelTimings:
    """Time each own kernel over the `linears` that offer it, in order (cold weights, as in a
    forward), and probe row invariance on `probe` (default: the first four linears, one layer)
    or, for a kernel none of those offers, on the first four that do. With `choices` (the
    kernels a plan chooses among) only those are probed, fastest first, up to the first that
    passes: the one `KernelTimings.plan` keeps (each probe costs as much as the timing).

    A count's time is the fastest of `repeats` rounds, each over every count of every kernel (as
    the cost curve is timed, spec/preparation.py): a burst of host noise then slows one round of
    several counts, rather than every sample of one count, which would outweigh the others' total."""
    paths = list(dict.fromkeys(p for lin in linears for p in lin.own_paths()))
    having = {p: [lin for lin in linears if p in lin.own_paths()] for p in paths}
    ms: dict[str, dict[int, float | None]] = {p: {} for p in paths}
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for m in rows:
            for p in paths:
                if r == 0 and _far_behind(ms, p):
                    ms[p][m] = None
                elif r == 0 or ms[p][m] is not None:          # not left behind in the first round
                    taken = samples.setdefault((p, m), [])
                    taken.append(_time_once(having[p], p, m, warm_up=r == 0 and m == rows[0]))
                    ms[p][m] = round(min(taken), 3)
    probe = probe or linears[:4]
    timed = KernelTimings(rows, ms, {})
    order = paths if choices is None else sorted(
        (p for p in choices if p in ms), key=lambda p: (timed.sampled_ms(p) is None, timed.sampled_ms(p) or 0))
    invariant: dict[str, bool] = {}
    for p in order:
        invariant[p] = row_invariant([lin for lin in probe if p in lin.own_paths()] or having[p][:4], p)
        if choices is not None and invariant[p]:
            break
    return replace(timed, invariant=invariant)


def _far_behind(ms: dict[str, dict[int, float | None]], path: str) -> bool:
    last = max(ms[path], default=None)
    if last is None or ms[path][last] is None:
        return last is not None
    best = min(t[last] for t in ms.values() if t.get(last) is not None)
    return ms[path][last] > max(SKIP_FACTOR * best, SKIP_MS)


@torch.inference_mode()
def _time_once(linears: list[QuantLinear], path: str, m: int, warm_up: bool = False) -> float:
    """Milliseconds for one run over `linears` at `m` rows, after an untimed one with `warm_up`
    (a kernel's first call sets up what later calls reuse)."""
    xs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}
    for _ in range(1 + int(warm_up)):
        start = time.perf_counter()
        for lin in linears:
            lin.run(path, xs[lin.in_features])
    return (time.perf_counter() - start) * 1e3


def cached_timings(rows: tuple[int, ...], model_key: dict, cache_dir: Path | None,
                   threads: int | None = None) -> KernelTimings | None:
    """What `load_or_time` keeps for this model and these rows on this machine, or None."""
    return cached_only(cache_dir, "", _timings_key(rows, model_key), KernelTimings.from_json, threads)


def load_or_time(rows: tuple[int, ...], model_key: dict, cache_dir: Path | None,
                 measure: Callable[[], KernelTimings], refresh: bool = False,
                 threads: int | None = None) -> KernelTimings:
    """This machine's cached timings for this model and these rows, else (or with
    `refresh`) `measure()`'s, which are cached."""
    return cached_measurement(cache_dir, "", _timings_key(rows, model_key), measure,
                              KernelTimings.to_json, KernelTimings.from_json, refresh, threads)


def _timings_key(rows: tuple[int, ...], model_key: dict) -> dict:
    return {"format": FORMAT, **model_key, "rows": list(rows)}
