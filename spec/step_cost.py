"""What a step costs, in milliseconds, as a function of its rows: the curve measured at load,
scaled by what steps cost now.

A verify step's forward costs what forwards of as many rows cost lately, on the same
thread count; a row count not run yet costs the curve measured on this machine at load,
scaled as the counts that were (longer contexts, a busy neighbour, fewer threads from the
governor move every count). On top of the forward, each drafting request costs its
drafter's time and each draft node its acceptance work (a softmax over the vocabulary at
T > 0), both measured while serving. A drafter can also slow the forward after it (a
datastore lookup did; docs/performance.md, "Adaptive speculation"): that is learned too, as
the forward's time after drafting less its time without, and is part of what drafting costs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


MIN_SEEN = 3     # forwards of a row count run before their own average replaces the scaled curve


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds of one forward at each measured row count (increasing), between them
    linear, past the last at the last two points' slope."""
    rows: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self):
        if not self.rows or len(self.rows) != len(self.ms) or list(self.rows) != sorted(set(self.rows)) \
                or self.rows[0] < 1 or min(self.ms) <= 0:
            raise ValueError(f"CostCurve needs increasing row counts from 1 and positive times, got "
                             f"{self.rows}, {self.ms}")

    @classmethod
    def measured(cls, timings: dict[int, float]) -> "CostCurve":
        """From raw timings: a count that timed below a smaller one (noise) takes that one's
        time, so that a larger tree never looks cheaper."""
        rows = sorted(timings)
        ms, top = [], 0.0
        for r in rows:
            top = max(top, timings[r])
            ms.append(top)
        return cls(tuple(rows), tuple(ms))

    def __call__(self, rows: int) -> float:
        r, t = self.rows, self.ms
        if rows <= r[0]:
            return t[0]
        i = bisect.bisect_left(r, rows)
        if i < len(r) and r[i] == rows:
            return t[i]
        lo, hi = (i - 1, i) if i < len(r) else (len(r) - 2, len(r) - 1)
        if lo < 0:
            return t[0] * rows / r[0]
        slope = (t[hi] - t[lo]) / (r[hi] - r[lo])
        return t[lo] + slope * (rows - r[lo])


@dataclass
class _Average:
    """A moving average that is the plain mean of its first 1 / weight values (one early
    value must not weigh for long)."""
    weight: float
    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += max(self.weight, 1 / self.count) * (x - self.value)

    def get(self, default: float) -> float:
        return self.value if self.count else default


@dataclass(frozen=True)
class StepSample:
    """One step as run, for `StepCost.observe`."""
    rows: int                   # the forward's rows (prefill chunks, decode tokens, draft nodes)
    decoding: int               # requests that emitted a token from a decode or verify row
    drafting: int               # requests the drafter proposed for
    nodes: int                  # draft nodes verified
    prefill: bool               # a prompt chunk ran in it (its rows are off the curve's range)
    forward_s: float
    draft_s: float              # the drafter's `propose`
    total_s: float              # the whole step
    proposed: int = 0           # draft nodes the drafter proposed (before the controller's cut)


class StepCost:
    """Milliseconds a step will take: `forward_ms(rows)` + per decoding request
    `request_ms()` (scheduling, sampling, emitting) + per drafting request `draft_ms()` (the
    drafter and the bookkeeping around it) + per draft node `node_ms()` (its acceptance work
    beyond the forward). Each is learned from the steps that isolate it: plain steps give the
    per-request time, drafted steps cut to no node the drafter's, the others the nodes'."""

    def __init__(self, curve: CostCurve, smoothing: float):
        self.curve = curve
        self.threads = 0                                        # the count steps run on now
        self._smoothing = smoothing
        self._forward: dict[tuple[int, int], _Average] = {}     # (threads, rows) -> ms, drafting's slowdown less
        self._undrafted: dict[tuple[int, int], _Average] = {}   # (threads, rows) -> ms of forwards without drafting
        self._slowdown = _Average(smoothing)                    # the forward's ms more after drafting, per request
        self._scale: dict[int, _Average] = {}                   # threads -> measured / curve
        self._propose = _Average(smoothing)                     # the drafter's own call, per request
        self._propose_node = _Average(smoothing)                # ... per node it proposed
        self._draft = _Average(smoothing)
        self._request = _Average(smoothing)
        self._node = _Average(smoothing)

    def forward_ms(self, rows: int) -> float:
        """What forwards of `rows` rows took lately on this thread count; a count not run yet:
        the curve scaled as the counts that were (the curve's shape is the machine's, the
        level moves with context, load and threads)."""
        seen = self._forward.get((self.threads, rows))
        if seen is not None and seen.count >= MIN_SEEN:
            return seen.value
        scale = self._scale.get(self.threads)
        return (scale.value if scale is not None else 1.0) * self.curve(rows)

    def draft_ms(self) -> float:
        """The drafter's time and its bookkeeping, per drafting request."""
        return self._draft.get(self._propose.get(0.0))

    def propose_node_ms(self) -> float:
        """The drafter's own call per node it proposed (its fixed part spread over them)."""
        return self._propose_node.get(0.0)

    def slowdown_ms(self) -> float:
        """How much longer a step's forward runs because a request drafted before it."""
        return max(0.0, self._slowdown.get(0.0))

    def drafting_ms(self) -> float:
        """All that drafting costs a step, per drafting request."""
        return self.draft_ms() + self.slowdown_ms()

    def request_ms(self) -> float:
        return self._request.get(0.0)

    def node_ms(self) -> float:
        return self._node.get(0.0)

    def observe(self, s: StepSample) -> None:
        """Learn from a step. Steps with a prompt chunk teach nothing: their forward is off the
        curve and their other work is the prompt's."""
        if s.prefill or not s.decoding or s.forward_s <= 0:
            return
        ms, key = s.forward_s * 1e3, (self.threads, s.rows)
        undrafted = self._undrafted.get(key)
        if not s.drafting:
            self._average(self._undrafted, key).add(ms)
        elif undrafted is not None and undrafted.count >= MIN_SEEN:
            self._slowdown.add((ms - undrafted.value) / s.drafting)
        ms -= s.drafting * self.slowdown_ms()
        self._average(self._forward, key).add(ms)
        self._average(self._scale, self.threads).add(ms / self.curve(s.rows))
        if s.drafting:
            self._propose.add(s.draft_s * 1e3 / s.drafting)
        if s.proposed:
            self._propose_node.add(s.draft_s * 1e3 / s.proposed)
        rest = (s.total_s - s.forward_s) * 1e3                  # everything around the forward
        if not s.drafting:
            self._request.add(rest / s.decoding)
        elif not s.nodes and self._request.count:
            self._draft.add(max(0.0, rest - s.decoding * self.request_ms()) / s.drafting)
        elif s.nodes and self._request.count:
            spent = s.decoding * self.request_ms() + s.drafting * self.draft_ms()
            self._node.add(max(0.0, rest - spent) / s.nodes)

    def _average(self, table: dict, key) -> _Average:
        a = table.get(key)
        if a is None:
            a = table[key] = _Average(self._smoothing)
        return a


class StatedCost(StepCost):
    """A step's cost as stated, never learned: the forward costs `curve` at every thread count,
    and the drafter's time and the acceptance work cost nothing. With it the adaptive
    controller's choices follow acceptance alone, never the host's timings: tests and what-if
    runs state a machine's curve (`AdaptiveConfig.cost_curve`) instead of timing this one."""

    def __init__(self, curve: CostCurve):
        super().__init__(curve, smoothing=1.0)

    def observe(self, s: StepSample) -> None:
        pass
