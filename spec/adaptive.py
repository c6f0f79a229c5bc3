"""Adaptive speculation: speculate only while it pays.

Each step the engine asks `enabled(batch_size)` and `draft_budget(batch_size)`; after a
pure decode step it reports what
happened with `observe(...)`. Speculation is off when the batch is larger than
`max_batch` (a big batch already fills the matmuls), or when the measured speculative
rate falls below the measured plain rate *at the same batch size*. Rates are tokens per
second per request (emitted tokens per step over the step time), kept as moving averages
per batch size: a step of 8 requests is slower than a step of 2 whatever the drafter
does, so comparing across batch sizes would blame (or credit) speculation for the load.
Probing keeps both averages fresh. While off for low acceptance, one step in `probe_every`
speculates anyway, so a drafter that starts to pay again (a new prompt, a repetitive
passage) is noticed. While on, one step in `probe_every` decodes plainly: otherwise the
plain rate would date from the first steps at that batch size, when contexts were shorter
and steps faster or slower, and a stale figure could keep speculation on after it stopped
paying. Probes cost throughput (a plain probe at 1.5x gives up a third of a step), so while
one mode leads by `wide_margin` or more, probes come 4 times less often: a lead that wide
takes many steps to erode.

Early steps are noisy (one rejected draft makes a slow speculative step): a slow average
started from one step kept speculation off for most of an in-process run at 1 request, and
in a server run most of the first round's requests decoded at plain speed. So each batch
size first measures `min_steps` steps of each mode; each average is the plain mean of its
steps until `1 / smoothing` are in; and until then probes keep their normal pace.

Acceptance swings from step to step (0 to 4 draft tokens), so the averages are slow: at
1 request (MT-bench, in-process), a weight of 0.2 for the newest step let runs of rejected
drafts turn speculation off for long stretches and lost throughput against always
speculating; with 0.05 it turned off less and came close to always on.

Below `max_batch`, the tree shrinks as the batch grows: each request may draft
`step_draft_tokens // batch` nodes (at least 1, at most its own budget), so a step verifies
about 6-9 tokens whatever the batch. Where the target's matmul cost jumps at some row count
(torch's int4 kernel works in blocks of 4 rows; the jump is measured at load), the step's
rows, one per request plus its draft nodes, stay below the jump where they can. In
closed-loop in-process runs with the datastore drafter (speculation always on against off),
3 draft nodes each did best at 2 requests, ahead of 4 each and of the 5 a lone request
drafts; at 4 requests 1 to 3 nodes each still paid and 5 each lost.

The default `max_batch` comes from closed-loop runs in-process with an n-gram chain of 4:
always speculating paid a little at 2 and 4 requests and lost at 8, where a step of 8 trees
took much longer than a step of 8 plain tokens.

Figures and commands: docs/performance.md, "Adaptive speculation".
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    enabled: bool = True        # False: always speculate when a drafter is set
    max_batch: int = 4          # running requests above which speculation is off
    probe_every: int = 32       # one step in this many runs the other way (see above)
    smoothing: float = 0.05     # weight of the newest step in the moving averages (see above)
    margin: float = 1.0         # speculate while spec_rate >= margin * plain_rate
    step_draft_tokens: int = 6  # draft nodes per step, shared by the running requests (see above)
    wide_margin: float = 1.25   # a lead this wide (either way) makes probes 4x rarer (see above)
    min_steps: int = 8          # steps of each mode measured before the two are compared

    def __post_init__(self):
        if self.max_batch < 1 or self.probe_every < 1 or not 0 < self.smoothing <= 1 or self.margin <= 0 \
                or self.step_draft_tokens < 1 or self.wide_margin < 1 or self.min_steps < 1:
            raise ValueError("AdaptiveConfig: need max_batch >= 1, probe_every >= 1, 0 < smoothing <= 1, "
                             "margin > 0, step_draft_tokens >= 1, wide_margin >= 1, min_steps >= 1")


@dataclass
class BatchRates:
    """Moving averages for one batch size (tokens/s per request), the last decision and how
    many decisions in a row went that way (which sets when to probe the other way)."""
    spec: float = 0.0           # meaningful once its step count is above 0
    plain: float = 0.0
    spec_steps: int = 0         # observations behind each average
    plain_steps: int = 0
    last: bool = True
    streak: int = 0


class AdaptiveController:
    def __init__(self, config: AdaptiveConfig = AdaptiveConfig(), step_rows: int | None = None):
        """`step_rows`: verify rows per step before the target's matmul cost jumps (measured
        at load; None: no such cliff). A step stays within it where it can."""
        self.config = config
        self.step_rows = step_rows
        self.rates: dict[int, BatchRates] = {}  # batch size -> what was measured at it
        self.state = True                       # what the last decision was (for metrics)

    def enabled(self, batch_size: int) -> bool:
        c = self.config
        if not c.enabled:
            self.state = True
        elif batch_size > c.max_batch:
            self.state = False
        else:
            self.state = self._decide(self._at(batch_size))
        return self.state

    def draft_budget(self, batch_size: int) -> int | None:
        """Draft nodes each request may propose in a step of `batch_size` running requests;
        None when adaptation is off (every request drafts its whole tree)."""
        if not self.config.enabled:
            return None
        batch = max(1, batch_size)
        tokens = self.config.step_draft_tokens
        if self.step_rows is not None:        # the batch's own rows count against the cliff
            tokens = min(tokens, self.step_rows - batch)
        return max(1, tokens // batch)

    def _at(self, batch_size: int) -> BatchRates:
        r = self.rates.get(batch_size)
        if r is None:
            r = self.rates[batch_size] = BatchRates()
        return r

    def _decide(self, r: BatchRates) -> bool:
        run_done = r.streak >= self._run_length(r) - 1      # the current run is long enough
        if r.spec_steps < self.config.min_steps or r.plain_steps < self.config.min_steps:
            on = r.spec_steps < self.config.min_steps     # measure both first: speculation first
        elif r.spec >= self.config.margin * r.plain:
            on = not (r.last and run_done)        # on, but probe plain decoding now and then
        else:
            on = not r.last and run_done          # off, but probe speculation now and then
        r.streak = r.streak + 1 if on == r.last else 1
        r.last = on
        return on

    def _run_length(self, r: BatchRates) -> int:
        """Steps one way between probes of the other."""
        c = self.config
        if min(r.spec_steps, r.plain_steps) * c.smoothing < 1:     # too few steps to trust a lead
            return c.probe_every
        lo, hi = sorted((r.spec, r.plain))
        return c.probe_every * 4 if hi >= c.wide_margin * lo else c.probe_every

    def observe(self, speculated: bool, decode_requests: int, tokens_per_request: float, seconds: float) -> None:
        """One decode step: how many tokens each decoding request emitted, and how long it took."""
        if decode_requests == 0 or seconds <= 0:
            return
        r = self._at(decode_requests)
        rate = tokens_per_request / seconds
        if speculated:
            r.spec_steps += 1
            r.spec = self._average(r.spec, r.spec_steps, rate)
        else:
            r.plain_steps += 1
            r.plain = self._average(r.plain, r.plain_steps, rate)

    def _average(self, mean: float, steps: int, rate: float) -> float:
        """The moving average after its `steps`-th step. Until 1 / smoothing steps are in it
        is the plain mean of all of them (the first step's weight is 1): a moving average
        started from its first step would carry that one step's luck for a long time."""
        a = max(self.config.smoothing, 1 / steps)
        return mean + a * (rate - mean)
