"""Adaptive speculation: speculate only while it pays.

Each step the engine asks `enabled(batch_size)`; after the step it reports what happened
with `observe(...)`. Speculation is off when the batch is larger than `max_batch` (a
big batch already fills the matmuls), or when the measured speculative rate (tokens per
second per request: emitted tokens per verify step over the step time) falls below the
measured plain rate. While off for low acceptance, one step in `probe_every` speculates
anyway, so a drafter that starts to pay again (a new prompt, a repetitive passage) is
noticed and speculation comes back on.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    enabled: bool = True        # False: always speculate when a drafter is set
    max_batch: int = 8          # running requests above which speculation is off
    probe_every: int = 16       # while off for low acceptance, speculate one step in this many
    smoothing: float = 0.2      # weight of the newest step in the moving averages
    margin: float = 1.0         # speculate while spec_rate >= margin * plain_rate

    def __post_init__(self):
        if self.max_batch < 1 or self.probe_every < 1 or not 0 < self.smoothing <= 1 or self.margin <= 0:
            raise ValueError("AdaptiveConfig: need max_batch >= 1, probe_every >= 1, "
                             "0 < smoothing <= 1, margin > 0")


class AdaptiveController:
    def __init__(self, config: AdaptiveConfig = AdaptiveConfig()):
        self.config = config
        self.spec_rate: float | None = None     # tokens/s per request while speculating
        self.plain_rate: float | None = None    # tokens/s per request while decoding plainly
        self._steps_off = 0
        self.state = True                       # what the last decision was (for metrics)

    def enabled(self, batch_size: int) -> bool:
        c = self.config
        if not c.enabled:
            self.state = True
        elif batch_size > c.max_batch:
            self.state = False
        elif self.spec_rate is None or self.plain_rate is None:
            self.state = self.spec_rate is None or self._steps_off >= 1  # measure both once
        elif self.spec_rate >= c.margin * self.plain_rate:
            self.state = True
        else:
            self.state = self._steps_off + 1 >= c.probe_every
        self._steps_off = 0 if self.state else self._steps_off + 1
        return self.state

    def observe(self, speculated: bool, decode_requests: int, tokens_per_request: float, seconds: float) -> None:
        """One decode step: how many tokens each decoding request emitted, and how long it took."""
        if decode_requests == 0 or seconds <= 0:
            return
        rate = tokens_per_request / seconds
        a = self.config.smoothing
        if speculated:
            self.spec_rate = rate if self.spec_rate is None else (1 - a) * self.spec_rate + a * rate
        else:
            self.plain_rate = rate if self.plain_rate is None else (1 - a) * self.plain_rate + a * rate
