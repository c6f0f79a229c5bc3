"""Continuous batching: who runs this step, with how many new tokens. Plain Python.

Rules, in order, each step:
1. Running requests, oldest first, each get their next tokens: one for a decode step,
   a chunk of the remaining prompt for a prefill, within the step's token budget. Their
   KV slots are reserved first; when the pool runs dry the newest running request is
   preempted (its blocks freed, recomputed later from its prompt + output so far).
2. If nothing was preempted, waiting requests are admitted first-come first-served while
   there is a free sequence slot, token budget and blocks for their whole prompt (prefix
   cache hits need no compute and no new block).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from spec.request import Request, Status
from verifier.block_manager import BlockManager, NoFreeBlocksError
from verifier.checks import positive_ints


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16                # requests decoding together
    max_num_batched_tokens: int = 512     # new tokens per forward (bounds a prefill chunk)
    max_model_len: int = 4096             # prompt + output tokens per request

    def __post_init__(self):
        positive_ints(self, ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))


@dataclass(frozen=True)
class Lookahead:
    """What a decoding request reserves beyond its next token this step (its tree's slots), and
    what the step carries for it from there: the grammar's forced tokens (jump-forward), or the
    fault its grammar raised (the request then fails alone)."""
    slots: int = 0
    forced: tuple[int, ...] = ()
    fault: Exception | None = None


NO_LOOKAHEAD = Lookahead()


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int          # tokens to run, starting at request.num_computed_tokens
    ahead: Lookahead = NO_LOOKAHEAD

    @property
    def num_lookahead(self) -> int:
        """Extra reserved slots (speculative tree nodes)."""
        return self.ahead.slots


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []     # in admission order: the last is the newest
        self.num_preemptions = 0             # since the start (metrics)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self, lookahead=lambda req: NO_LOOKAHEAD) -> SchedulerOutput:
        """`lookahead(req)`: a decoding request's extra slots this step (and what its plan carries)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue                      # preempted earlier in this loop
            n = min(req.num_uncomputed, budget)
            ahead = NO_LOOKAHEAD if req.in_prefill else lookahead(req)
            if self._reserve(req, req.num_computed_tokens + n + ahead.slots, out):
                out.seqs.append(ScheduledSeq(req, n, ahead))
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _reserve(self, req: Request, num_slots: int, out: SchedulerOutput) -> bool:
        """Make room for num_slots tokens of req, preempting the newest requests if needed."""
        while True:
            try:
                self.blocks.ensure_slots(req.seq_id, num_slots)
                return True
            except NoFreeBlocksError:
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return False

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.blocks.can_allocate(req.token_ids, req.cache_root):
                break                         # FCFS: do not let later requests jump the queue
            cached = self.blocks.allocate(req.seq_id, req.token_ids, req.cache_root)
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = cached
                req.admit_time = time.perf_counter()
            req.num_computed_tokens = cached
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_uncomputed, budget)
            out.seqs.append(ScheduledSeq(req, n))
            budget -= n

    def preempt(self, req: Request) -> None:
        self.blocks.free(req.seq_id)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Release a request wherever it is (running, waiting or already finished)."""
        if req.status is Status.RUNNING:
            self.blocks.free(req.seq_id)
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        for req in self.running:
            if not self.blocks.has(req.seq_id) or req.status is not Status.RUNNING:
                raise AssertionError(f"running request {req.request_id} holds no blocks")
        for req in self.waiting:
            if self.blocks.has(req.seq_id):
                raise AssertionError(f"waiting request {req.request_id} still holds blocks")
