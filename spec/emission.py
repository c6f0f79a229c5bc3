"""The emit phase: a plan's tokens appended to its request one by one until a stop (EOS, a stop
string or token, the grammar's end, max_tokens, the context), the prompt's full blocks published
to the prefix cache, then the request finished (its blocks back to the pool, the drafter told)
or its rejected tree slots dropped; and the `RequestOutput` a caller sees. Every block-manager
change of a step happens here, plan by plan in batch order: which of two equal blocks the
prefix cache keeps, and the order blocks go back to the pool, depend on it.
"""
from __future__ import annotations

import time

from spec.drafting import Drafting
from spec.faults import RequestError
from spec.plan import SeqPlan
from spec.prompt_logprobs import prompt_logprobs
from spec.request import Request, RequestOutput
from spec.scheduler import Scheduler
from verifier.block_manager import BlockManager
from verifier.target import TargetModel


class Emission:
    def __init__(self, target: TargetModel, blocks: BlockManager, scheduler: Scheduler, drafting: Drafting,
                 requests: dict[str, Request], eos_ids: frozenset[int], max_model_len: int):
        """`requests`: the engine's live requests by id (a finished one leaves it here)."""
        self.target, self.blocks, self.scheduler, self.drafting = target, blocks, scheduler, drafting
        self.requests, self.eos_ids, self.max_model_len = requests, eos_ids, max_model_len

    def emit(self, plan: SeqPlan) -> RequestOutput | None:
        req = plan.request
        if plan.mid_prefill:        # more prompt to come: publish its full blocks, emit nothing
            self.blocks.publish(req.seq_id, req.token_ids, req.num_computed_tokens)
            return None
        if req.params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = prompt_logprobs(self.target, self.blocks, -2 - req.seq_id, req.prompt_token_ids,
                                                  req.params.prompt_logprobs, req.adapter)
        added, reason = self._append_tokens(req, plan.tokens)
        if plan.logprobs is not None:
            req.logprobs += plan.logprobs[:len(added)]
        if plan.drafted is not None and plan.proposal.num_draft_nodes > plan.forced:
            req.spec.emitted_tokens += len(added) - plan.forced_accepted
        # Publish before a finish frees the blocks: the next turn of a chat reuses them.
        self.blocks.publish(req.seq_id, req.token_ids, min(req.num_computed_tokens, req.num_tokens))
        if reason:
            self.scheduler.finish(req, reason)
            return self.finalize(req, added)
        self.blocks.truncate(req.seq_id, req.num_computed_tokens)   # drop rejected tree slots
        return self._output(req, added)

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append tokens one by one until one finishes the request (a stop inside an accepted
        path discards the rest). Returns the tokens added and the finish reason, if any."""
        added = []
        for t in tokens:
            req.token_ids.append(t)
            added.append(t)
            if req.grammar is not None and not req.grammar.accept(t):
                # Unreachable: every token was sampled or accepted under this matcher's mask.
                raise AssertionError(f"request {req.request_id}: token {t} outside its grammar")
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            req.detok.add(req.output_token_ids)
            reason = self._finish_reason(req, t)
            if reason:
                return added, reason
        return added, None

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if req.detok.stopped_by is not None or token in p.stop_token_ids:
            return "stop"
        if token in self.eos_ids and not p.ignore_eos:
            return "stop"
        if req.grammar is not None and req.grammar.terminated:
            return "stop"           # the grammar took its stop token: nothing may follow
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def fail(self, req: Request, e: Exception) -> RequestOutput:
        """End a request that failed alone: finish_reason "error", its blocks back to the pool."""
        req.error = RequestError.of(e)
        self.scheduler.finish(req, "error")
        return self.finalize(req)

    def finalize(self, req: Request, added: list[int] | None = None) -> RequestOutput:
        self.drafting.learn(req)
        self.drafting.release(req)
        req.finish_time = time.perf_counter()
        req.detok.flush(req.output_token_ids)
        del self.requests[req.request_id]
        return self._output(req, added or [])

    def _output(self, req: Request, added: list[int]) -> RequestOutput:
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        total = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=req.detok.text, token_ids=req.output_token_ids, finished=req.finished,
            finish_reason=req.finish_reason, delta_text=req.detok.take_delta(req.finished),
            delta_token_ids=added, ttft=ttft, total_time=total,
            queue_time=None if req.admit_time is None else req.admit_time - req.arrival_time,
            num_cached_tokens=req.num_cached_prompt_tokens, stats=req.spec, error=req.error,
            logprobs=None if req.params.logprobs is None else list(req.logprobs),
            prompt_logprobs=req.prompt_logprobs, stop_string=req.detok.stopped_by)
