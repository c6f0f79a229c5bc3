"""Choose the CPU matmul paths for sampled and prefill rows by measuring them on this machine, once.

Decode and tree-verify rows always take one of the weight's own kernels (torch's int4 or
Tercel's q4x16 for int4 weights, torch's int8 for int8), whose rows are bitwise the same
whatever else shares the call: the one with the lowest total over 1 to 8 rows, the counts
decode steps and verify trees use (which is faster differs between machines: the q4x16
kernel's integer dot products are one instruction with AVX-512 VNNI and three with AVX2).
Prefill rows need the same property: a
prompt prefilled alone or inside a batch, in one chunk or after a prefix-cache hit, must
leave the same KV cache, or T=0 outputs drift apart at near-ties (bf16 activations make
those common). oneDNN's dense matmuls are not row-invariant across row counts (bf16 on
AMX switches kernels with the count), but with a fixed row count a row's result does not
depend on its place in the call. So prefill rows go through the dense path in tiles of a
fixed number of rows, the last one padded with zeros, and a path qualifies only if a probe
at load finds it position-invariant at that tile.

Which qualifying path is fastest differs between machines of one kind (bf16 with AMX is
several times faster than fp32 on one; without bf16 instructions it is among the slowest),
so the paths are timed at the row counts the engine uses and the cheapest per prefill row
is kept. Timings and probes are cached per (CPU model and flags, torch version, threads,
model, quantization, row counts) under the Tercel cache folder; `tercel bench kernels`
prints them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from verifier.cpu.machine import cached_measurement
from verifier.quantized.own_kernels import OWN_PATHS
from verifier.quantized.qlinear import QuantLinear

FORMAT = 7           # 6: the sampled rows' kernel is chosen too (q4x16 against torch's int4);
                     # 7: on the head's scan where no decoder weight offers a choice
# A path that took over SKIP_MS and SKIP_FACTOR times the best at one count is not timed at
# larger counts (at prompt-sized counts an int4 kernel is several times slower than oneDNN, and
# timing it would add seconds to a load; figures: docs/performance.md, "Matmul paths and
# quantized kernels").
SKIP_FACTOR, SKIP_MS = 3.0, 100.0
CLIFF = 1.4          # see KernelTimings.rows_before_cliff
TILES = (32, 64, 128)  # prefill tile sizes tried, smallest first
SAMPLED_ROWS = 8       # the own kernel is chosen on its total over 1 to this many rows


@dataclass(frozen=True)
class KernelPlan:
    """Prefill rows take `bulk` in calls of exactly `tile` rows (0: any count; the weight's
    own kernels need no tiles); sampled rows take the own kernel `own` ("": the weight's kind).
    A prompt chunk of fewer than `own_below` rows costs less on `own`: where a chunk's KV need
    not be the same however the prompt is chunked (a draft model's), it runs there."""
    bulk: str
    tile: int = 0
    own: str = ""
    own_below: int = 1


@dataclass(frozen=True)
class KernelTimings:
    """Milliseconds for the decoder matmuls of one forward, per path and row count (None:
    not timed, already far behind at a smaller count), and the tiles at which each path
    passed the row-invariance probe."""
    rows: tuple[int, ...]
    ms: dict[str, dict[int, float | None]]
    tiles: dict[str, list[int]]      # tile sizes at which each path passed the probe (0: any count)

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

    def per_row_ms(self, path: str, tile: int) -> float | None:
        """Cost per prompt row on `path` in calls of `tile` rows (0: whole prefill chunks)."""
        rows = tile or max(self.rows)
        t = self.ms.get(path, {}).get(rows)
        return None if t is None else t / rows

    def sampled_ms(self, path: str) -> float | None:
        """The total over 1 to SAMPLED_ROWS rows (None: a count not timed)."""
        t = [self.ms.get(path, {}).get(m) for m in self.rows if m <= SAMPLED_ROWS]
        return None if not t or None in t else sum(t)

    def plan(self, owns: tuple[str, ...]) -> KernelPlan:
        """Sampled rows: the own kernel among `owns` (the weight's row-invariant kernels) with
        the lowest `sampled_ms` that passed the probe at any count (the first one without
        timings). Prefill rows: the (path, tile) with the lowest cost per prompt row among those
        that passed the probe, the chosen own kernel as the fallback."""
        timed = {p: c for p in owns if self.tiles.get(p) == [0] and (c := self.sampled_ms(p)) is not None}
        own = min(timed, key=timed.get, default=owns[0])
        mixed = self._mixed(owns)
        costs = {(p, t): c for p, tiles in self.tiles.items() for t in tiles
                 if (p == own and not mixed or p not in OWN_PATHS) and (c := self.per_row_ms(p, t)) is not None}
        bulk, tile = min(costs, key=costs.get, default=(own, 0))
        return KernelPlan(bulk, tile, own, 1 if bulk == own or mixed else self._own_below(bulk, tile, own))

    def _own_below(self, bulk: str, tile: int, own: str) -> int:
        """The smallest timed row count at which a prompt chunk costs no more on `bulk` (whole
        tiles of `tile` rows) than on `own`."""
        for m in self.rows:
            o, b = self.ms.get(own, {}).get(m), self.ms.get(bulk, {}).get(tile or m)
            if o is None or b is not None and -(-m // (tile or m)) * b <= o:
                return m
        return self.rows[-1]

    def _mixed(self, owns: tuple[str, ...]) -> bool:
        # Own kernels timed over other linears too (a file mixing formats): the own path's times
        # cover only its kind's linears, so it cannot be weighed against a dense path's.
        return any(p in OWN_PATHS and p not in owns for p in self.ms)

    def to_json(self) -> dict:
        return {"rows": list(self.rows), "ms": {p: {str(m): t for m, t in v.items()} for p, v in self.ms.items()},
                "tiles": self.tiles}

    @classmethod
    def from_json(cls, d: dict) -> "KernelTimings":
        return cls(tuple(d["rows"]), {p: {int(m): t for m, t in v.items()} for p, v in d["ms"].items()},
                   d["tiles"])


def choosable_owns(linears: list[QuantLinear]) -> tuple[str, ...]:
    """The own kernels the plan chooses among: those of the linears that offer a choice (int4
    weights: torch's or q4x16; the head's scan last), else the first linear's. A model whose file
    mixes formats (a Q4_K_M) has linears with one own kernel beside them (q4k, q8x16), which keep it."""
    return next((lin.own_paths() for lin in linears if len(lin.own_paths()) > 1), linears[0].own_paths())


@torch.inference_mode()
def invariant_tiles(lins: list[QuantLinear], path: str) -> list[int]:
    """[0] when every probed row count gives each row the bits it has in a larger call (the
    weight's own kernels); else the TILES at which a row's bits do not depend on its place
    in a call of that many rows (none: the path cannot serve prompt rows)."""
    def same(m: int, offsets: tuple[int, ...], full: int) -> bool:
        for lin in lins:
            x = torch.randn(full, lin.in_features, generator=torch.Generator().manual_seed(m))
            ref = lin.run(path, x[:m])
            if not all(torch.equal(lin.run(path, x[o:o + m])[:m - o], ref[o:]) for o in offsets):
                return False
        return True
    if all(_rows_match(lins, path, m) for m in (1, 3, 8, 33)):
        return [0]
    return [t for t in TILES if same(t, (1, 7, 16), 2 * t)]


def _rows_match(lins: list[QuantLinear], path: str, m: int, seeds: int = 4) -> bool:
    """The first m rows of a 64-row call equal an m-row call, for several inputs: a path whose
    sums run in another order for m rows shows it only now and then after bf16 rounding."""
    for lin in lins:
        for seed in range(seeds):
            x = torch.randn(64, lin.in_features, generator=torch.Generator().manual_seed(1000 * m + seed))
            if not torch.equal(lin.run(path, x[:m]), lin.run(path, x)[:m]):
                return False
    return True


def engine_rows(prefill_chunk: int) -> tuple[int, ...]:
    """Row counts worth timing: 1 to 8 (decode steps and verify trees; torch's int4 kernel
    changes cost every 4 rows), then powers of two up to the prefill chunk, and the chunk.
    The same for every drafter and batch size, so that one measurement serves them all."""
    rows = set(range(1, 9)) | {prefill_chunk} | {1 << i for i in range(prefill_chunk.bit_length())}
    return tuple(sorted(r for r in rows if r <= prefill_chunk))


def time_paths(linears: list[QuantLinear], rows: tuple[int, ...], repeats: int = 3,
               probe: list[QuantLinear] | None = None) -> KernelTimings:
    """Time each path over the `linears` that offer it, in order (cold weights, as in a forward),
    and probe each path's row invariance on `probe` (default: the first four linears, one layer)
    or, for a path none of those offers, on the first four that do."""
    paths = list(dict.fromkeys(p for lin in linears for p in lin.paths()))
    having = {p: [lin for lin in linears if p in lin.paths()] for p in paths}
    ms: dict[str, dict[int, float | None]] = {p: {} for p in paths}
    for m in rows:
        for p in paths:
            ms[p][m] = None if _far_behind(ms, p) else _time_one(having[p], p, m, repeats)
    probe = probe or linears[:4]
    return KernelTimings(rows, ms, {p: invariant_tiles([lin for lin in probe if p in lin.paths()] or having[p][:4], p)
                                    for p in paths})


def _far_behind(ms: dict[str, dict[int, float | None]], path: str) -> bool:
    last = max(ms[path], default=None)
    if last is None or ms[path][last] is None:
        return last is not None
    best = min(t[last] for t in ms.values() if t.get(last) is not None)
    return ms[path][last] > max(SKIP_FACTOR * best, SKIP_MS)


@torch.inference_mode()
def _time_one(linears: list[QuantLinear], path: str, m: int, repeats: int) -> float:
    xs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}
    samples = []
    for i in range(repeats + 1):               # the first run builds oneDNN's kernels
        start = time.perf_counter()
        for lin in linears:
            lin.run(path, xs[lin.in_features])
        if i:
            samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 3)


def load_or_time(rows: tuple[int, ...], model_key: dict, cache_dir: Path | None,
                 measure: Callable[[], KernelTimings], refresh: bool = False,
                 threads: int | None = None) -> KernelTimings:
    """This machine's cached timings for this model and these rows, else (or with
    `refresh`) `measure()`'s, which are cached."""
    return cached_measurement(cache_dir, "", {"format": FORMAT, **model_key, "rows": list(rows)}, measure,
                              KernelTimings.to_json, KernelTimings.from_json, refresh, threads)
