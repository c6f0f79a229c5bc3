"""How many CPU threads each engine step runs on, measured while serving.

On a machine of its own the engine is fastest on every CPU it may use. Beside other work it
is not: when a neighbour holds a core, an OpenMP thread of the engine waits at every barrier
of a step (hundreds per forward) for a partner the kernel has not scheduled, and a step can
take several times longer on two threads than on one (figures: docs/performance.md, "Shared
CPUs"). Which count is faster depends on what else runs, so it is measured, not guessed:

- Every so often the governor *probes*: it runs `probe_pairs` pairs of consecutive steps,
  the first of each pair on the current count and the second on a neighbouring one (one
  fewer, or one more up to the budget), and compares the two steps of each pair. Adjacent
  steps do nearly the same work; only pairs of the same shape count: rows and sequences in
  the forward, each rounded to a power of two (a batch that changes every step, requests
  coming and going with trees of varying size, rarely repeats its exact counts, and probes
  that never found a pair left the engine on two threads beside a neighbour). It moves to
  fewer threads when the median ratio says they are faster by `margin`, and back toward the
  budget when more are faster at all: all threads is the
  default, and leaving it must pay. (In the server, whose event loop shares the CPUs, two
  threads were only a little faster per step than one on a quiet machine: with `margin` both
  ways the governor stayed on one thread after a neighbour had left; docs/performance.md,
  "Shared CPUs".)
- The first probe comes after `probe_pairs` steps (a short run beside a neighbour gains from the
  first), then every `first_interval` steps, twice as far apart each time the current count
  wins, up to `max_interval`: a settled machine pays for few probes, and a neighbour that leaves
  is still noticed. Two events probe at once: a step `slowdown` times slower than the recent
  steps of its shape (a neighbour arrived: the probe tries one thread fewer, that step as the
  first of its first pair), and, below the budget, idle CPUs appearing where
  there were none (a neighbour left: at least `idle_cpus` of the process's CPUs sat idle over the
  last `idle_every` steps, after a check that found fewer; verifier/cpu/cpus.py:IdleMeter). Only the
  change probes, so a machine with idle CPUs the governor does not use (a quota) is not probed
  again and again. After a switch probes start again at `first_interval`, next in the same
  direction (from 8 threads to 7, then to 6 if that pays too).
- A probe costs most where it is least needed: beside a neighbour a step on the extra thread
  can take several on fewer. So a probe decides as soon as the pairs left could not change its
  median, or two pairs agree that one count is `clear` times faster; and
  while no CPU sat idle at the last reading the governor probes up only every `max_interval`
  steps (room appearing probes at once, as above).
- A neighbour that arrives while the engine waits for work would slow its next step, often a
  prompt's and the longest, before any probe: after `gap_s` without steps the governor reads
  the CPUs that sat idle meanwhile (the engine used none) and runs on at most that many. The
  first steps after the engine's load run on the CPUs other processes left free during it
  (`start`; verifier/cpu/cpus.py:free_cpus).

Exactness does not depend on it: every kernel computes each row on one thread in a fixed order,
so a row's bits are the same on any thread count (tests/engine/test_threads.py runs the engine with
the count changing every step). The engine also checks it at load, with a scratch forward on
1, all but one and all threads, and keeps the count fixed where they differ.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verifier.cpu.machine import on_threads


@dataclass(frozen=True)
class ThreadConfig:
    adaptive: bool = True        # False: every step runs on the engine's thread count
    probe_pairs: int = 4         # step pairs behind one comparison (one noisy pair cannot decide)
    margin: float = 0.9          # fewer threads when their steps take under this share (see above)
    first_interval: int = 32     # steps between probes after a switch (see the module's docstring)
    max_interval: int = 1024     # the longest wait between probes (idle CPUs cut it short)
    slowdown: float = 1.5        # a step this much slower than its shape's recent ones probes now
    idle_every: int = 16         # steps between readings of the idle CPUs (below the budget only)
    idle_cpus: float = 0.5       # this many idle on average means room for another thread
    clear: float = 2.0           # two pairs this far apart either way decide a probe early
    gap_s: float = 0.2           # after this long without steps, the first step reads the idle CPUs

    def __post_init__(self):
        if self.probe_pairs < 1 or not 0 < self.margin <= 1 or self.first_interval < 1 \
                or self.max_interval < self.first_interval or self.slowdown <= 1 or self.idle_every < 1 \
                or self.idle_cpus <= 0 or self.clear <= 1 or self.gap_s <= 0:
            raise ValueError("ThreadConfig: need probe_pairs >= 1, 0 < margin <= 1, first_interval >= 1, "
                             "max_interval >= first_interval, slowdown > 1, idle_every >= 1, idle_cpus > 0, "
                             "clear > 1, gap_s > 0")


log = logging.getLogger("tercel.threads")

Shape = tuple[int, int]      # (rows in the forward, sequences): steps of one shape do the same work


def shape_of(rows: int, seqs: int) -> Shape:
    """The shape a step is compared by: its counts rounded down to powers of two."""
    return 1 << (max(1, rows).bit_length() - 1), 1 << (max(1, seqs).bit_length() - 1)


@dataclass
class Probe:
    """One comparison under way: the count tried against the current one, the pairs so far."""
    candidate: int
    ratios: list[float] = field(default_factory=list)   # candidate step / current step, per pair
    first: tuple[Shape, float] | None = None              # the pair's current-count step, waiting
    steps: int = 0


class ThreadGovernor:
    def __init__(self, max_threads: int, config: ThreadConfig = ThreadConfig(),
                 idle: Callable[[], float | None] | None = None, gap_idle: Callable[[], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, start: int | None = None):
        """`max_threads`: the budget (verifier/cpu/cpus.py, or the configured count); the governor
        starts there (or at `start`, where that is fewer: other processes hold CPUs) and never
        goes above it. `idle()`: the process's CPUs that sat idle on average since the last call
        (None: unknown); without it only probes find a quiet machine. `gap_idle()`: the same, a
        second meter whose windows end at the gaps between steps."""
        self.config, self.max_threads = config, max(1, max_threads)
        self._idle, self._was_idle, self._steps = idle, True, 0
        self._gap_idle, self._clock = gap_idle, clock
        self._last_step = self._marked = None       # when the last step ended; gap_idle last read
        self.threads = self.max_threads     # the count steps run on outside probes
        self.switches = 0                   # switches so far (for metrics)
        self._interval = config.first_interval
        self._until_probe = config.probe_pairs
        self._probe: Probe | None = None
        self._recent: dict[Shape, float] = {}   # shape -> moving average of its steps' seconds
        self._down = True                        # which neighbour the next probe tries
        if self.active and start is not None and start < self.max_threads:
            self.threads, self._was_idle, self._down = max(1, start), False, False   # up once room appears

    @property
    def active(self) -> bool:
        return self.config.adaptive and self.max_threads > 1

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def next_step(self) -> int:
        """The thread count for the next step."""
        if self.active and self._after_gap():
            self._fit_to_idle()
        p = self._probe
        if p is None or p.first is None:
            return self.threads
        return p.candidate

    def observe(self, rows: int, seqs: int, seconds: float) -> None:
        """The step just run: rows and sequences in its forward, and its wall time."""
        if not self.active or seconds <= 0:
            return
        self._mark_gap_window()
        shape = shape_of(rows, seqs)
        if self._probe is not None:
            self._probe_step(shape, seconds)
            return
        if self._slowed(shape, seconds):
            if self.threads > 1:        # fewer threads first; this step is the pair's first half
                self._probe = Probe(self.threads - 1, first=(shape, seconds))
                return
            self._until_probe = 0
        elif self._room_appeared():
            self._until_probe, self._down = 0, False
        self._remember(shape, seconds)
        self._until_probe -= 1
        if self._until_probe <= 0:
            self._start_probe()

    def _mark_gap_window(self) -> None:
        """Starts gap_idle's window anew every eighth of a gap while steps run: a gap's reading
        then covers at most that much of the engine's own work."""
        if self._gap_idle is None:
            return
        self._last_step = now = self._clock()
        if self._marked is None or now - self._marked >= self.config.gap_s / 8:
            self._gap_idle()
            self._marked = now

    def _after_gap(self) -> bool:
        return self._gap_idle is not None and self._last_step is not None \
            and self._clock() - self._last_step >= self.config.gap_s

    def _fit_to_idle(self) -> None:
        """After a gap: at most as many threads as CPUs sat idle meanwhile. The engine used none
        then, so CPUs that were busy are a neighbour's, and its first step (often a prompt's, the
        longest) would wait on them at every barrier."""
        self._last_step = self._marked = None
        if self._probe is not None:        # its pairs would straddle the gap: start it again later
            self._probe, self._until_probe = None, self.config.probe_pairs
        idle = self._gap_idle()
        if idle is None:
            return
        room = max(1, int(idle + 1 - self.config.idle_cpus))     # as _room_appeared counts a CPU
        if room >= self.threads:
            return
        log.debug("threads: %.1f CPUs idle while the engine was, %d -> %d", idle, self.threads, room)
        self._switch(room)
        self._down = self._was_idle = False    # more threads once room appears (_room_appeared)

    def _slowed(self, shape: Shape, seconds: float) -> bool:
        recent = self._recent.get(shape)
        return recent is not None and seconds > self.config.slowdown * recent

    def _room_appeared(self) -> bool:
        """Below the budget, every `idle_every` steps: idle CPUs now, after a reading without."""
        self._steps += 1
        if self._idle is None or self.threads >= self.max_threads or self._steps % self.config.idle_every:
            return False
        idle = self._idle()
        if idle is None:
            return False
        appeared = idle >= self.config.idle_cpus and not self._was_idle
        self._was_idle = idle >= self.config.idle_cpus
        return appeared

    def _remember(self, shape: Shape, seconds: float) -> None:
        recent = self._recent.get(shape)
        self._recent[shape] = seconds if recent is None else recent + 0.2 * (seconds - recent)

    def _start_probe(self) -> None:
        down, up = self.threads - 1, self.threads + 1
        options = [n for n in ((down, up) if self._down else (up, down)) if 1 <= n <= self.max_threads]
        if self._crowded():
            options = [n for n in options if n < self.threads]
        if not options:
            self._interval = min(2 * self._interval, self.config.max_interval)
            self._until_probe = self._interval
            return
        self._probe = Probe(options[0])

    def _crowded(self) -> bool:
        """No idle CPU at the last reading: another thread would only queue behind a neighbour,
        and a step on it costs several on fewer (docs/performance.md, "Shared CPUs"). Probes up
        wait for room then, but for one every `max_interval` steps (a neighbour of lower priority
        keeps the CPUs busy yet yields them)."""
        return self._idle is not None and not self._was_idle and self._interval < self.config.max_interval

    def _probe_step(self, shape: Shape, seconds: float) -> None:
        p = self._probe
        p.steps += 1
        if p.first is None:
            p.first = (shape, seconds)
        else:
            (first_shape, first_seconds), p.first = p.first, None
            if first_shape == shape:
                p.ratios.append(seconds / first_seconds)
        if len(p.ratios) >= self.config.probe_pairs or self._settled(p):
            self._decide(p)
        elif p.steps >= 8 * self.config.probe_pairs and p.first is None:   # shapes kept changing
            self._probe = None
            self._until_probe = self._interval

    def _switch(self, threads: int) -> None:
        self.threads, self.switches = threads, self.switches + 1
        self._recent.clear()                            # the old count's step times say nothing now
        self._interval = self.config.first_interval
        self._until_probe = self._interval

    def _settled(self, p: Probe) -> bool:
        """Whether the probe may decide before `probe_pairs`: each step on the slower count may
        cost several (a neighbour's barriers). It may once most of the pairs it would take lie on
        one side of the threshold (the rest cannot move the median across), or two pairs agree
        that one count is faster by `clear` times."""
        r, c = p.ratios, self.config.clear
        below = sum(x < self._threshold(p) for x in r)
        most = self.config.probe_pairs // 2 + 1
        return below >= most or len(r) - below >= most or (len(r) >= 2 and (min(r) > c or max(r) < 1 / c))

    def _threshold(self, p: Probe) -> float:
        """The candidate wins below this median ratio: by the margin for fewer threads, at all for more."""
        return self.config.margin if p.candidate < self.threads else 1.0

    def _decide(self, p: Probe) -> None:
        self._probe = None
        log.debug("threads: %d against %d, step time ratios %s", p.candidate, self.threads,
                  " ".join(f"{r:.2f}" for r in p.ratios))
        if statistics.median(p.ratios) < self._threshold(p):
            self._down = p.candidate < self.threads     # keep going the way that paid
            self._switch(p.candidate)
            if self._idle is not None:                  # idle readings start over from here
                self._idle()
                self._was_idle = True
        else:
            self._down = not self._down                 # try the other neighbour next time
            self._interval = min(2 * self._interval, self.config.max_interval)
        self._until_probe = self._interval


def same_on_every_count(forward: Callable[[], torch.Tensor], counts: list[int]) -> bool:
    """Whether `forward()` (logits of a scratch forward) gives the same bits on each thread
    count; the caller's count is set back afterwards."""
    results = []
    for n in counts:
        with on_threads(n):
            results.append(forward())
    return all(torch.equal(results[0], r) for r in results[1:])
