"""The engine: requests in, one step at a time, outputs out.

One step: schedule -> draft (a token tree per decoding request) -> verify (one target
forward over prefill chunks and every tree) -> accept (exact rejection sampling) ->
commit (move accepted KV into place) -> emit (detokenize, stop checks, publish full blocks
to the prefix cache). Plain decoding is the same loop without a drafter. Each phase has its
room, and this file only runs them in order:

  spec/preparation.py   the target made ready, once, at load (KV pool, drafter, warm-up, costs)
  spec/intake.py        a request checked and built
  spec/scheduler.py     admission, chunking, tree slots, preemption
  spec/drafting.py      who drafts and how much; the proposals; every call on the drafter
  spec/constraints.py   a constrained request's masks and pruned tree (the rules of docs/structured.md)
  spec/verification.py  the forward (a failing request isolated) and the KV commit
  spec/acceptance.py    exact acceptance, sampling, logprobs
  spec/emission.py      tokens appended, stops, publish, finish; the outputs
  spec/step_meter.py    what a step cost, told to the cost model, the batch guard and threads

A request with a grammar (`SamplingParams.structured`) gets its masks in draft (pruning
the tree, spec/constraints.py), applies them in accept and advances its matcher in emit;
where the grammar forces tokens they are its tree this step (jump-forward), with or
without a drafter. A request with a prediction (OpenAI's Predicted Outputs) gets the
prediction's chain in its tree, joined to the drafter's proposal (drafters/prediction.py),
also with no drafter.
"""
from __future__ import annotations

import atexit
import gc
import logging
from dataclasses import replace
from functools import partial

import torch

from spec.acceptance import Acceptance, held_back
from spec.adaptive import AdaptiveController
from spec.batch_guard import BatchGuard
from spec.config import EngineConfig
from spec.constraints import constrain_plan
from spec.drafting import Drafting
from spec.emission import Emission
from spec.faults import RequestFault
from spec.intake import Intake
from spec.plan import SeqPlan
from spec.preparation import prepare
from spec.request import Request, RequestOutput, Submission
from spec.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from spec.stats import EngineLimits, EngineStats
from spec.step_cost import StatedCost
from spec.step_meter import StepClock, StepMeter
from spec.verification import Verification
from verifier.batch import ForwardOutput
from verifier.cpu.machine import on_threads
from verifier.sampling.grammar import GrammarBackend
from verifier.sampling.sampling_params import SamplingParams
from verifier.target import generation_eos_ids


log = logging.getLogger("tercel.engine")


def freeze_loaded_objects() -> None:
    """Moves every live object out of the cyclic GC's reach, until the process exits: what a
    long-lived server loaded, so that a full collection (triggered by allocation-heavy steps such
    as n-gram indexing of a long prompt) does not walk it (docs/performance.md, "Engine step").
    Not the engine's own doing: a frozen cycle is never collected, so an engine dropped in a
    longer-lived process (a script, the tests) would keep its memory."""
    gc.collect()
    gc.freeze()
    # Exit's collection must see them again: cycles left frozen outlive finalization, and nanobind
    # bindings among them (triton's, which torch._dynamo imports) print leak warnings at exit.
    atexit.unregister(gc.unfreeze)          # one hook, however often a process freezes
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        ready = prepare(config)             # spec/preparation.py: load, KV pool, drafter, warm-up, costs
        self.target, self.blocks, self.adapters, self.drafter = ready.target, ready.blocks, ready.adapters, \
            ready.drafter
        self.max_model_len, self.spec_config, self.memory = ready.max_model_len, ready.spec_config, ready.memory
        self.threads, self.num_threads, self.cpu_budget = ready.threads, ready.num_threads, ready.cpu_budget
        self._memory_parts = tuple(self.memory.parts().items())     # for stats(), after every step
        self.tokenizer = self.target.tokenizer
        mc = self.target.config
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.blocks)
        self.eos_ids = frozenset(mc.eos_token_ids) | set(generation_eos_ids(self.target.model_dir)) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.requests: dict[str, Request] = {}
        # Compiles `SamplingParams.structured`; xgrammar loads on the first constrained request.
        self.grammars = GrammarBackend(self.tokenizer, mc.vocab_size, sorted(self.eos_ids), config.grammar)
        limits = EngineLimits(self.max_model_len, config.max_num_seqs, mc.vocab_size, self.blocks.block_size,
                              self.blocks.num_total_blocks, config.drafter or None, self.spec_config)
        self.intake = Intake(self.tokenizer, self.eos_ids, limits, self.adapters, self.grammars, config.seed,
                             self.target)
        self._pending: list[RequestOutput] = []
        self.adaptive = AdaptiveController(config.adaptive)
        self.adaptive.cost = ready.cost
        # measured costs only: a stated curve pins the controller's choices, and so the guard's
        measured = self.adaptive.active and not isinstance(self.adaptive.cost, StatedCost)
        self.guard = BatchGuard(replace(config.adaptive.guard, enabled=config.adaptive.guard.enabled and measured))
        held = partial(held_back, eos_ids=self.eos_ids)        # what min_tokens masks, per request
        self.acceptance = Acceptance(self.adaptive, config.logprobs_mode, held)
        self.drafting = Drafting(self.drafter, self.spec_config, self.adaptive, self.guard, self.adapters,
                                 self.max_model_len, config.max_num_batched_tokens, config.jump_forward,
                                 held)
        self.verification = Verification(self.target, self.blocks, self.drafter.capture_layers if self.drafter else ())
        self.meter = StepMeter(self.adaptive, self.guard, self.threads, self.drafting)
        self.emission = Emission(self.target, self.blocks, self.scheduler, self.drafting, self.requests,
                                 self.eos_ids, self.max_model_len)

    # ---- requests in ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.intake.tokenize(prompt)

    def add_request(self, request_id: str, submission: Submission) -> Request:
        """Validate and queue (spec/intake.py); ValueError (naming the problem) leaves no state behind."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.intake.request(request_id, submission)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt and these params can never run here (read-only)."""
        self.intake.limits.validate(ids, params)

    def limits(self) -> EngineLimits:
        """What a request may ask of this engine; fixed once it is loaded."""
        return self.intake.limits

    def stats(self) -> EngineStats:
        """A snapshot between two steps, for readers outside the engine (metrics, benchmarks)."""
        on = self.drafter is not None and self.adaptive.state
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.blocks.num_total_blocks, kv_blocks_free=self.blocks.num_free_blocks,
            prefix_cache_queries=self.blocks.prefix_queries, prefix_cache_hits=self.blocks.prefix_hits,
            speculating=on, draft_budget=self.adaptive.last_budget if on else 0, drafter_errors=self.drafting.errors,
            batch_guard=self.guard.leaders(),
            preemptions=self.scheduler.num_preemptions, threads=self.threads.threads,
            max_threads=self.num_threads, thread_switches=self.threads.switches,
            thread_steps=tuple(self.meter.thread_steps[n] for n in sorted(self.meter.thread_steps)),
            steps=self.meter.steps, last_step_tokens=self.meter.last_step_tokens,
            timing=self.meter.timing, memory=self._memory_parts,
            **self.adapters.stats(self.scheduler.running, self.scheduler.waiting))

    # ---- LoRA adapters (spec/adapters.py) ------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        self.adapters.load(name, path)

    def unload_lora(self, name: str) -> int:
        """Stop serving adapter `name`: its requests, running or waiting, fail alone (finish_reason
        "error", their blocks back to the pool); returns how many."""
        slot = self.adapters.slot(name)
        under = [r for r in self.requests.values() if r.adapter == slot and not r.finished]
        for req in under:
            self._pending.append(self.emission.fail(req, RequestFault(f"LoRA adapter {name!r} was unloaded")))
        self.adapters.unload(name)
        log.info("LoRA adapter %r unloaded (%d requests under it failed)", name, len(under))
        return len(under)

    def reset_prefix_cache(self) -> int:
        """Drop the cached blocks no request holds; returns how many."""
        return self.blocks.reset_prefix_cache()

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self.emission.finalize(req))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> draft -> verify -> accept -> commit -> emit, each phase over the batch,
        on the thread count the governor picks; the caller's count is set back after, so code
        outside the engine never inherits the governor's."""
        with on_threads(self.threads.next_step()):
            if self.adaptive.cost is not None:
                self.adaptive.cost.threads = torch.get_num_threads()
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []     # aborted since the last step
        clock = StepClock()
        sched = self._schedule()
        if sched.is_empty:
            return outputs
        plans = self._draft(sched)
        clock.mark("drafted")
        fwd = self._forward(plans)
        clock.mark("verified")
        self.drafting.prefill(plans)
        self._accept(plans)
        self.verification.commit(plans)
        new = self._emit(plans)
        self.drafting.observe(plans, fwd)      # after emit: finished requests are skipped
        clock.mark("end")
        self.meter.observe(plans, clock)
        return outputs + new

    # ---- schedule -------------------------------------------------------------------------
    def _schedule(self) -> SchedulerOutput:
        """The adaptive controller caps each running request's tree, then the scheduler
        reserves each decoding request's tree slots (lookahead) with its tokens."""
        self.drafting.plan(self.scheduler.running)
        sched = self.scheduler.schedule(lookahead=self.drafting.lookahead)
        for req in sched.preempted:
            self.drafting.release(req)
        return sched

    # ---- draft ----------------------------------------------------------------------------
    def _draft(self, sched: SchedulerOutput) -> list[SeqPlan]:
        """The drafting room's plans (spec/drafting.py), then each constrained request's masks."""
        plans = self.drafting.draft(sched)
        constrained = [p for p in plans if p.request.grammar is not None and not p.mid_prefill]
        self._each(constrained, "constrain", constrain_plan)
        return plans

    # ---- verify (spec/verification.py) ---------------------------------------------------
    def _forward(self, plans: list[SeqPlan]) -> ForwardOutput | None:
        """One target forward over the plans that have not failed (bench/step_times.py times it)."""
        return self.verification.forward(plans)

    def probe(self) -> bool:
        """Whether a one-token forward on scratch blocks passes (False also when no block is free)."""
        return self.verification.probe()

    # ---- accept ---------------------------------------------------------------------------
    def _accept(self, plans: list[SeqPlan]) -> None:
        """Each plan's tokens (spec/acceptance.py), each plan alone: what one raises fails that
        request only. Tokens come back to the host as ints: at least one device sync per plan."""
        self._each(plans, "accept", self.acceptance.accept)

    # ---- emit (spec/emission.py) ----------------------------------------------------------
    def _emit(self, plans: list[SeqPlan]) -> list[RequestOutput]:
        """Each plan's output in batch order (the order the block manager's changes must keep);
        a request that failed in any phase, or fails here, gets its error output alone."""
        return [out for plan in plans if (out := self._emit_one(plan)) is not None]

    def _emit_one(self, plan: SeqPlan) -> RequestOutput | None:
        if plan.fault is None:
            try:
                return self.emission.emit(plan)
            except Exception as e:   # noqa: BLE001 - this request's alone (its grammar, its stop strings)
                self._note_fault(plan, "emit", e)
        return self.emission.fail(plan.request, plan.fault)

    def _each(self, plans: list[SeqPlan], phase: str, fn) -> None:
        """fn(plan) for each plan not yet faulted; what one raises faults that plan alone."""
        for plan in plans:
            if plan.fault is None:
                try:
                    fn(plan)
                except Exception as e:   # noqa: BLE001 - the request fails in emit, the step goes on
                    self._note_fault(plan, phase, e)

    @staticmethod
    def _note_fault(plan: SeqPlan, phase: str, e: Exception) -> None:
        plan.fault = e
        if isinstance(e, RequestFault):
            log.info("request %s failed in %s: %s", plan.request.request_id, phase, e)
        else:
            log.error("request %s failed in %s", plan.request.request_id, phase, exc_info=e)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """Release the target's processes (the worker ranks under tensor parallelism) and the
        grammar compiler's."""
        self.grammars.close()
        self.target.close()
