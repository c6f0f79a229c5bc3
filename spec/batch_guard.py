"""Whether speculation pays end to end at the batch's size, measured, not modelled.

The adaptive controller (spec/adaptive.py) prices each draft node from the step's cost curve,
the drafter's time and the acceptance work, each part from the steps that isolate it. At 4 or
16 requests the tokens speculation gains are few against a step that already emits one per
request, so the parts' errors add up to the margin: there the drafting engine's forwards took as
long in total as plain ones and what drafting costs around them was the loss (docs/performance.md,
"Speculation under load"). So the guard measures the outcome: per batch size (the decoding
requests, in powers of two), the milliseconds per emitted token of steps that may speculate
against steps that may not, each in windows of `window` decode steps of that size, and lets the
batch speculate while its windows are the cheaper.

The losing mode is measured again every `every` windows, twice as far apart each time it loses
again (at most `max_every`), back to `every` when the winner changes: a batch size where
speculation pays spends about one window in `max_every` plain, and one where it does not about
one in `max_every` speculating. A window's figure is its total time over its total tokens, and
each mode keeps a moving average of its windows (`memory`), so a stray slow step moves it little.

A lone request is left to the controller (`min_batch`): there the request's choice is the
step's, its pricing was checked against plain decoding directly (docs/performance.md, "Adaptive
speculation"), and one request's windows compare different stretches of its own text, whose
acceptance varies more than speculation's gain.

Steps with a prompt chunk are not measured (their time is the prompt's). The choice depends on
past steps only and only decides whether requests draft, so the output stays exactly the
target's; seeded sampled requests keep their trees (the engine does not ask the guard for them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SPECULATE, PLAIN = "speculate", "plain"


@dataclass(frozen=True)
class GuardConfig:
    enabled: bool = True
    window: int = 8           # decode steps of one batch size per measured window
    every: int = 4            # windows of the winning mode between windows of the losing one
    max_every: int = 64       # ... at most, after it lost again and again
    memory: float = 0.7       # weight a mode's earlier windows keep at each new one
    min_batch: int = 2        # decoding requests from which it decides (below: the controller alone)

    def __post_init__(self):
        if self.window < 1 or not 1 <= self.every <= self.max_every or not 0 <= self.memory < 1 \
                or self.min_batch < 1:
            raise ValueError("GuardConfig needs window >= 1, 1 <= every <= max_every, 0 <= memory < 1 "
                             "and min_batch >= 1")


@dataclass
class _Size:
    """One batch size's windows: the mode leading (the cheaper so far), the mode of the window
    now measured and its running sums, each mode's average ms per token, and the leader's
    windows left before the other mode is measured again."""
    leader: str = SPECULATE
    mode: str = SPECULATE
    steps: int = 0
    ms: float = 0.0
    tokens: int = 0
    rate: dict[str, float] = field(default_factory=dict)     # mode -> ms per token
    every: int = 0
    until_check: int = 0


def _other(mode: str) -> str:
    return PLAIN if mode == SPECULATE else SPECULATE


class BatchGuard:
    def __init__(self, config: GuardConfig = GuardConfig()):
        self.config = config
        self.sizes: dict[int, _Size] = {}

    @staticmethod
    def bucket(decoding: int) -> int:
        """The batch size class: 1, 2, 4, 8, ... (the largest power of two not above `decoding`)."""
        return 1 << (max(decoding, 1).bit_length() - 1)

    def speculates(self, decoding: int) -> bool:
        """Whether a step of `decoding` requests may draft."""
        if not self.config.enabled or decoding < self.config.min_batch:
            return True
        return self._size(decoding).mode == SPECULATE

    def leaders(self) -> tuple[tuple[int, bool], ...]:
        """(batch size, whether speculation leads there) for each size it has decided for, ascending
        (speculation leads until plain windows measure cheaper)."""
        return tuple((k, s.leader == SPECULATE) for k, s in sorted(self.sizes.items()))

    def observe(self, decoding: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prompt chunk) of `decoding` requests that emitted `tokens` in
        `seconds`; `speculated`: whether it ran in a window that may draft."""
        if not self.config.enabled or decoding < self.config.min_batch or tokens < 1 or seconds <= 0:
            return
        s = self._size(decoding)
        if speculated != (s.mode == SPECULATE):      # the mode was read before a change of size
            return
        s.steps, s.ms, s.tokens = s.steps + 1, s.ms + seconds * 1e3, s.tokens + tokens
        if s.steps >= self.config.window:
            self._close_window(s)

    def _size(self, decoding: int) -> _Size:
        key = self.bucket(decoding)
        s = self.sizes.get(key)
        if s is None:
            s = self.sizes[key] = _Size(every=self.config.every, until_check=self.config.every)
        return s

    def _close_window(self, s: _Size) -> None:
        c, rate = self.config, s.ms / s.tokens
        old = s.rate.get(s.mode)
        s.rate[s.mode] = rate if old is None else c.memory * old + (1 - c.memory) * rate
        s.steps, s.ms, s.tokens = 0, 0.0, 0
        other = _other(s.leader)
        if s.mode == other:                 # a check ended: the leader changes if it lost
            if s.rate[other] < s.rate[s.leader]:
                s.leader, s.every = other, c.every
            else:
                s.every = min(2 * s.every, c.max_every)
            s.mode, s.until_check = s.leader, s.every
            return
        s.until_check -= 1
        if other in s.rate and s.rate[s.leader] > s.rate[other]:
            s.until_check = 0               # the leader now costs more than the other did: check at once
        if s.until_check <= 0:
            s.mode = other
