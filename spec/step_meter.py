"""What each engine step cost, measured around its phases and told to those that learn from it:
the adaptive controller's cost curve (a `StepSample`), the batch guard (a decode step's tokens and
time), the thread governor (the step's time on its thread count), and the engine's cumulative
figures (`PhaseTimes` of speculative steps, steps per thread count) that `LLMEngine.stats` reports.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spec.adaptive import AdaptiveController
from spec.batch_guard import BatchGuard
from spec.drafting import Drafting
from spec.plan import SeqPlan
from spec.stats import PhaseTimes, ThreadSteps
from spec.step_cost import StepSample
from spec.threads import ThreadGovernor


@dataclass
class StepClock:
    """perf_counter marks of one step: begun, drafted (plans made), verified (forward done), ended."""
    start: float = field(default_factory=time.perf_counter)
    drafted: float = 0.0
    verified: float = 0.0
    end: float = 0.0

    def mark(self, phase: str) -> None:
        setattr(self, phase, time.perf_counter())


class StepMeter:
    def __init__(self, adaptive: AdaptiveController, guard: BatchGuard, threads: ThreadGovernor, drafting: Drafting):
        self.adaptive, self.guard, self.threads, self.drafting = adaptive, guard, threads, drafting
        self.timing = PhaseTimes()      # the speculative steps' phases, cumulative
        self.steps = self.last_step_tokens = 0                  # forward steps so far, the last one's tokens
        self.thread_steps: dict[int, ThreadSteps] = {}          # the same by the thread count they ran on

    def observe(self, plans: list[SeqPlan], clock: StepClock) -> None:
        """A step that ran a forward over `plans`, timed by `clock`."""
        total = clock.end - clock.start
        if any(p.drafted is not None for p in plans):
            self.timing = self.timing.plus(clock.drafted - clock.start, clock.verified - clock.drafted,
                                           clock.end - clock.verified)
        prefill = any(p.is_prompt for p in plans)
        self._cost(plans, prefill, clock.verified - clock.drafted, total)
        self._guard(plans, prefill, total)
        self.last_step_tokens = sum(p.num_rows for p in plans)
        self.steps += 1
        n = torch.get_num_threads()
        self.thread_steps[n] = self.thread_steps.get(n, ThreadSteps(n)).plus(total)
        self.threads.observe(self.last_step_tokens, len(plans), total)

    def _cost(self, plans: list[SeqPlan], prefill: bool, forward_s: float, total_s: float) -> None:
        """The step's costs, for the adaptive controller."""
        if self.adaptive.cost is None:
            return
        decoding = sum(1 for p in plans if p.proposal is not None or p.seq.num_new_tokens == 1)
        nodes = sum(p.proposal.num_draft_nodes - p.forced for p in plans if p.drafted is not None)
        drafts = self.drafting.step
        self.adaptive.cost.observe(StepSample(sum(p.num_rows for p in plans), decoding, drafts.requests, nodes,
                                              prefill, forward_s, drafts.seconds, total_s, drafts.nodes))

    def _guard(self, plans: list[SeqPlan], prefill: bool, total_s: float) -> None:
        """A decode step's tokens and time, for the batch guard (prompt chunks' steps are not its)."""
        guarded, self.drafting.guarded = self.drafting.guarded, None
        if guarded is None or prefill:
            return
        tokens = sum(len(p.tokens) for p in plans)
        self.guard.observe(guarded[0], guarded[1], tokens, total_s)
