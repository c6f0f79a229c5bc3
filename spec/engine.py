"""The engine: requests in, one step at a time, outputs out.

One step: schedule -> draft (a token tree per decoding request) -> verify (one target
forward over prefill chunks and every tree) -> accept (exact rejection sampling) ->
commit (move accepted KV into place, publish full blocks to the prefix cache) -> emit
(detokenize, stop checks). Plain decoding is the same loop without a drafter.

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
import time
from dataclasses import replace

import torch

from drafters.base import Prediction
from drafters.config import SpecConfig
from spec.adaptive import AdaptiveController
from spec.batch_guard import BatchGuard
from spec.config import EngineConfig
from spec.constraints import constrain
from spec.detokenizer import IncrementalDetokenizer
from spec.drafting import Drafting, candidate
from spec.faults import NO_TOKEN_ALLOWED, RequestError, RequestFault
from spec.prompt_logprobs import prompt_logprobs
from spec.rejection import accept_greedy, accept_tree
from spec.plan import SeqPlan
from spec.request import Request, RequestOutput
from spec.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from spec.stats import EngineLimits, EngineStats, PhaseTimes, ThreadSteps
from spec.preparation import prepare
from spec.step_cost import StatedCost, StepSample
from verifier.attention.kv_cache import slot_of
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.cpu.machine import on_threads
from verifier.model.tokenizer import prompt_ids
from verifier.sampling.grammar import GrammarBackend, apply_bitmask, few_allowed, sole_tokens
from verifier.sampling.logprobs import TokenLogprob, decided, row_logprob
from verifier.sampling.sampler import greedy_token, make_generator, sample_token, target_probs, transform_logits
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
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self._pending: list[RequestOutput] = []
        self._steps = self._last_step_tokens = 0  # forward steps so far, and the last one's tokens
        self._thread_steps: dict[int, ThreadSteps] = {}     # the same by the thread count they ran on
        self.adaptive = AdaptiveController(config.adaptive)
        self.adaptive.cost = ready.cost
        self.timing = PhaseTimes()      # the speculative steps' phases, cumulative
        # measured costs only: a stated curve pins the controller's choices, and so the guard's
        measured = self.adaptive.active and not isinstance(self.adaptive.cost, StatedCost)
        self.guard = BatchGuard(replace(config.adaptive.guard, enabled=config.adaptive.guard.enabled and measured))
        self.drafting = Drafting(self.drafter, self.spec_config, self.adaptive, self.guard, self.adapters,
                                 self.max_model_len, config.max_num_batched_tokens, config.jump_forward,
                                 self._held_back)

    # ---- requests in ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, speculate: bool = True,
                    speculation: SpecConfig | None = None, grammar=None,
                    prediction: Prediction | None = None, lora: str | None = None) -> Request:
        """Validate and queue; ValueError (naming the problem) leaves no state behind.
        `speculate=False` decodes this request plainly; `speculation` caps its tree (depth,
        top-k, budget) below the engine's own SpecConfig; `grammar`: params.structured already
        compiled (the server compiles before queueing; the cache may have dropped it since);
        `prediction`: the reply the client expects, drafted (ignored when not speculating);
        `lora`: the name of the LoRA adapter it runs under (None: the base model)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self.adapters.slot(lora)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate(ids, params)
        if prediction is not None:
            self.limits().validate_prediction(ids, params, prediction)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, ids, params,
                      IncrementalDetokenizer.of(self.tokenizer, params, params.finishing_ids(self.eos_ids)),
                      prompt=prompt if isinstance(prompt, str) else None,
                      generator=make_generator(seed, self.target.device))
        req.speculate = speculate
        req.adapter, req.cache_root = adapter, self.adapters.cache_root(adapter)
        req.speculation = self._cap_speculation(speculation)
        req.prediction = prediction if speculate else None    # it only speeds a reply up: off means off
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured) if grammar is None \
                else self.grammars.matcher_of(grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _cap_speculation(self, spec: SpecConfig | None) -> SpecConfig | None:
        if spec is None:
            return None
        over = self.spec_config.first_above(spec.num_speculative_tokens, spec.topk, spec.max_nodes)
        if over:
            raise ValueError("speculation {} {} exceeds the server's limit {}".format(*over))
        return spec

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt and these params can never run here (read-only)."""
        self.limits().validate(ids, params)

    def limits(self) -> EngineLimits:
        """What a request may ask of this engine; fixed once it is loaded."""
        return EngineLimits(self.max_model_len, self.config.max_num_seqs, self.target.config.vocab_size,
                            self.blocks.block_size, self.blocks.num_total_blocks,
                            self.config.drafter or None, self.spec_config)

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
            thread_steps=tuple(self._thread_steps[n] for n in sorted(self._thread_steps)),
            steps=self._steps, last_step_tokens=self._last_step_tokens,
            timing=self.timing, memory=self._memory_parts,
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
            self._pending.append(self._fail(req, RequestFault(f"LoRA adapter {name!r} was unloaded")))
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
        self._pending.append(self._finalize(req))

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
        start = time.perf_counter()
        sched = self._schedule()
        if sched.is_empty:
            return outputs
        plans = self._draft(sched)
        drafted = time.perf_counter()
        fwd = self._verify(plans)
        verified = time.perf_counter()
        self.drafting.prefill(plans)
        self._accept(plans)
        self._commit(plans)
        new = self._emit(plans)
        self.drafting.observe(plans, fwd)      # after emit: finished requests are skipped
        end = time.perf_counter()
        speculated = any(p.drafted is not None for p in plans)
        if speculated:
            self.timing = self.timing.plus(drafted - start, verified - drafted, end - verified)
        prefill = any(p.is_prompt for p in plans)
        self._observe(plans, prefill, verified - drafted, end - start)
        self._observe_guard(plans, prefill, end - start)
        self._last_step_tokens = sum(p.num_rows for p in plans)
        self._steps += 1
        n = torch.get_num_threads()
        self._thread_steps[n] = self._thread_steps.get(n, ThreadSteps(n)).plus(end - start)
        self.threads.observe(self._last_step_tokens, len(plans), end - start)
        return outputs + new

    def _observe(self, plans: list[SeqPlan], prefill: bool, forward_s: float, total_s: float) -> None:
        """The step's costs, for the adaptive controller."""
        if self.adaptive.cost is None:
            return
        decoding = sum(1 for p in plans if p.proposal is not None or p.seq.num_new_tokens == 1)
        nodes = sum(p.proposal.num_draft_nodes - p.forced for p in plans if p.drafted is not None)
        drafts = self.drafting.step
        self.adaptive.cost.observe(StepSample(sum(p.num_rows for p in plans), decoding, drafts.requests, nodes,
                                              prefill, forward_s, drafts.seconds, total_s, drafts.nodes))

    def _observe_guard(self, plans: list[SeqPlan], prefill: bool, total_s: float) -> None:
        """A decode step's tokens and time, for the batch guard (prompt chunks' steps are not its)."""
        guarded, self.drafting.guarded = self.drafting.guarded, None
        if guarded is None or prefill:
            return
        tokens = sum(len(p.tokens) for p in plans)
        self.guard.observe(guarded[0], guarded[1], tokens, total_s)

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
        self._each(constrained, "constrain", self._constrain)
        return plans

    @staticmethod
    def _constrain(plan: SeqPlan) -> None:
        """A constrained request's masks, one per row it samples from; its tree pruned to them."""
        matcher = plan.request.grammar
        if plan.proposal is None:
            plan.masks = matcher.mask()
            if not plan.masks.any():
                raise RequestFault(NO_TOKEN_ALLOWED)
        else:
            plan.proposal, plan.masks = constrain(plan.proposal, matcher)
        plan.sole = sole_tokens(plan.masks)

    # ---- verify ---------------------------------------------------------------------------
    def _verify(self, plans: list[SeqPlan]) -> ForwardOutput | None:
        """One target forward over every plan's new tokens (prefill chunks, plain decode tokens,
        whole trees), ragged and flattened in plan order: plan rows first_row .. + num_rows.
        Plans that failed earlier in the step are left out (None: no plan left). A forward
        that raises is run again without the plans that fail alone (`_isolate`)."""
        live = [p for p in plans if p.fault is None]
        try:
            return self._forward(live)
        except Exception:   # noqa: BLE001 - attributed below, or raised again
            log.exception("target forward over %d sequences failed; looking for the request at fault", len(live))
            self._isolate(live)
        return self._forward([p for p in live if p.fault is None])

    def _forward(self, plans: list[SeqPlan]) -> ForwardOutput | None:
        if not plans:
            return None
        row = 0
        for plan in plans:
            plan.first_row, row = row, row + plan.num_rows
        layers = self.drafter.capture_layers if self.drafter else ()
        fwd = self.target.forward(ForwardBatch([self._seq_input(p) for p in plans], capture_layers=layers))
        for i, plan in enumerate(plans):
            plan.logits = fwd.seq_logits(i)    # a view of fwd.logits: [len(sample_indices), V]
        return fwd

    def _isolate(self, plans: list[SeqPlan]) -> None:
        """Fault each plan whose forward fails alone. Rewriting a plan's KV slots writes the
        same values, so a plan that passes alone is unchanged. When every plan fails, the fault
        is the request's only if a scratch forward still passes; otherwise it is the engine's
        and is raised (the server fails every request and reports itself unhealthy)."""
        failed = []
        for plan in plans:
            try:
                self._forward([plan])
            except Exception as e:   # noqa: BLE001 - this plan's own failure
                failed.append((plan, e))
        if len(failed) == len(plans) and not self.probe():
            raise failed[0][1]
        for plan, e in failed:
            plan.fault = e

    def probe(self) -> bool:
        """Whether a one-token forward on scratch blocks passes (False also when no block is free)."""
        if self.blocks.blocks_needed(None, 1) > self.blocks.num_free_blocks:
            return False
        try:
            with self.blocks.scratch(-1, 1) as table:
                self.target.forward(ForwardBatch([SeqInput([0], 0, table, logits_indices=[0])]))
        except Exception:   # noqa: BLE001 - the answer is no
            log.exception("probe forward failed")
            return False
        return True

    def _seq_input(self, plan: SeqPlan) -> SeqInput:
        req, start = plan.request, plan.ctx_len
        table = self.blocks.block_table(req.seq_id)
        if plan.proposal is not None:
            tree = plan.proposal.tree       # root at slot `start`, node j at start + j
            return SeqInput(list(tree.tokens), start, table, positions=tree.positions(start),
                            mask=tree.ancestor_mask(), logits_indices=plan.logit_rows,
                            logits_tokens=self._few_allowed(plan, plan.logit_rows), adapter=req.adapter)
        # Logits of the last token only; none for a chunk with more of the prompt after it, or
        # where the grammar allows one token. The last token is a sampled row either way.
        n = plan.seq.num_new_tokens
        sampled = not plan.mid_prefill and plan.logit_rows
        return SeqInput(req.token_ids[start:start + n], start, table, logits_indices=None if sampled else [],
                        sampled_from=None if plan.mid_prefill else n - 1,
                        logits_tokens=self._few_allowed(plan, [0]) if sampled else None, adapter=req.adapter)

    def _few_allowed(self, plan: SeqPlan, rows: list[int]) -> tuple | None:
        """Per logits row of a constrained plan, the tokens its mask allows if they are few."""
        return None if plan.masks is None else few_allowed(plan.masks, rows, self.target.config.vocab_size)

    # ---- accept ---------------------------------------------------------------------------
    def _accept(self, plans: list[SeqPlan]) -> None:
        """Choose each plan's tokens from the target's logits. A tree: its accepted path plus one
        corrected or bonus token (exact rejection sampling). A plain decode step or a prompt's
        last chunk: one token sampled from its last row. A mid-prompt chunk: none. Tokens come
        back to the host as ints: at least one device sync per plan. Each plan alone: what one
        raises fails that request only."""
        self._each(plans, "accept", self._accept_one)

    def _accept_one(self, plan: SeqPlan) -> None:
        req = plan.request
        if plan.masks is not None and plan.logits.shape[0]:
            # in place: the rows of this forward only
            apply_bitmask(plan.logits, plan.masks[plan.logit_rows])
            if not torch.isfinite(plan.logits).any(-1).all():
                raise RequestFault(NO_TOKEN_ALLOWED)
        if plan.proposal is not None:
            plan.accepted, plan.tokens = self._accept_proposal(req, plan)
            # the forced chain is nodes 1..forced: the accepted path runs through it first
            plan.forced_accepted = sum(1 for j in plan.accepted if j <= plan.forced)
            req.spec.forced_tokens += plan.forced_accepted
            if plan.predicted:
                self._count_prediction(req, plan)
            if plan.drafted is not None:
                self._count(req, plan.proposal.num_draft_nodes - plan.forced,
                            plan.proposal.tree.max_depth - plan.forced, len(plan.accepted) - plan.forced_accepted)
                if not plan.forced and plan.masks is None and req.history is not None:
                    self.adaptive.observe(candidate(req, plan.proposal), plan.accepted)
        elif not plan.mid_prefill and plan.sole and plan.sole[0] >= 0:
            plan.tokens = [plan.sole[0]]                # the grammar allows this one token
        elif not plan.mid_prefill:
            plan.tokens = [sample_token(plan.logits[-1], req.params, req.prompt_token_ids,
                                        req.output_token_ids, req.generator, self._held_back(req.params))]
        if plan.tokens and req.params.logprobs is not None:
            plan.logprobs = self._logprobs(plan)

    def _logprobs(self, plan: SeqPlan) -> list[TokenLogprob]:
        """Each chosen token's logprob under the row that predicted it: a tree's root, then its
        accepted nodes; a plain step's last row. Rows the grammar decides have no logits."""
        req, k = plan.request, plan.request.params.logprobs
        if plan.proposal is None:
            if plan.sole and plan.sole[0] >= 0:
                return [decided(plan.tokens[0], k)]
            return [row_logprob(plan.logits[-1], plan.tokens[0], k, self.config.logprobs_mode, req.params,
                                req.prompt_token_ids, req.output_token_ids, self._held_back(req.params))]
        tree, rows = plan.proposal.tree, {u: i for i, u in enumerate(plan.logit_rows)}
        out = []
        for u, token in zip((0, *plan.accepted), plan.tokens):
            if u not in rows:
                out.append(decided(token, k))
            else:
                before = req.output_token_ids + tree.path_tokens(u)[1:]
                out.append(row_logprob(plan.logits[rows[u]], token, k, self.config.logprobs_mode, req.params,
                                       req.prompt_token_ids, before, self._held_back(req.params)))
        return out

    def _accept_proposal(self, req: Request, plan: SeqPlan) -> tuple[tuple[int, ...], list[int]]:
        """Exact acceptance over the plan's verified tree (plan.logits: a raw row per
        plan.logit_rows node); returns the accepted tree nodes and the tokens to emit. A node
        whose grammar allows one token (plan.sole) has the one-hot distribution on it."""
        prop, logits, sole = plan.proposal, plan.logits, plan.sole
        tree, p = prop.tree, req.params
        prompt, output, held = req.prompt_token_ids, req.output_token_ids, self._held_back(p)
        row = [-1] * tree.num_nodes                 # node -> its logits row, -1 where it has none
        for i, u in enumerate(plan.logit_rows):
            row[u] = i

        def node_logits(u: int) -> torch.Tensor:
            # Penalties and min_tokens see every token up to node u: the output plus u's path below the root.
            return transform_logits(logits[row[u]], p, prompt, output + tree.path_tokens(u)[1:], held)

        def node_probs(u: int) -> torch.Tensor:
            if row[u] < 0:
                one_hot = torch.zeros(logits.shape[-1], device=logits.device)
                one_hot[sole[u]] = 1.0
                return one_hot
            return target_probs(node_logits(u)[None], p)[0]

        if p.greedy:
            result = accept_greedy(tree, lambda u: sole[u] if row[u] < 0 else greedy_token(node_logits(u)))
        else:
            result = accept_tree(tree, node_probs, prop.draft, req.generator)
        return result.accepted, [tree.tokens[j] for j in result.accepted] + [result.token]

    def _held_back(self, p: SamplingParams) -> frozenset[int]:
        """The ids min_tokens masks (none without it): what would end the request."""
        return p.finishing_ids(self.eos_ids) if p.min_tokens else frozenset()

    @staticmethod
    def _count_prediction(req: Request, plan: SeqPlan) -> None:
        """The prediction's tokens verified this step (what the cut and the grammar left of its
        chain) and how many of them were accepted."""
        nodes = plan.proposal.tree.follow(plan.predicted, plan.forced)
        accepted = len(set(nodes) & set(plan.accepted))
        req.spec.prediction_accepted += accepted
        req.spec.prediction_rejected += len(nodes) - accepted

    @staticmethod
    def _count(req: Request, nodes: int, max_depth: int, accepted: int) -> None:
        """Verify steps with at least one of the drafter's nodes (a bare root is a plain decode
        step): its nodes, the tree's depth and how many of them were accepted."""
        if not nodes:
            return
        st = req.spec
        st.verify_steps += 1
        st.draft_tokens += nodes
        st.accepted_tokens += accepted
        while len(st.accepted_per_depth) < max_depth:
            st.accepted_per_depth.append(0)
        for d in range(accepted):
            st.accepted_per_depth[d] += 1

    # ---- commit ---------------------------------------------------------------------------
    def _commit(self, plans: list[SeqPlan]) -> None:
        """Advance each request's computed tokens. A tree keeps the KV of its root and accepted
        path, moved into consecutive slots; its rejected slots are truncated in emit, after the
        publish (or freed with the request if it finishes)."""
        for plan in plans:
            if plan.fault is not None:
                continue
            if plan.proposal is not None:
                self._commit_kv(plan.request, plan.accepted)
            else:
                plan.request.num_computed_tokens += plan.seq.num_new_tokens

    def _commit_kv(self, req: Request, accepted: tuple[int, ...]) -> None:
        """Accepted node j (verified at slot ctx + j) moves to slot ctx + depth; the rest is dropped."""
        ctx, table, bs = req.num_computed_tokens, self.blocks.block_table(req.seq_id), self.blocks.block_size
        moves = [(slot_of(table, ctx + j, bs), slot_of(table, ctx + d, bs))
                 for d, j in enumerate(accepted, start=1) if j != d]
        if moves:
            self.target.copy_slots([m[0] for m in moves], [m[1] for m in moves])
        req.num_computed_tokens = ctx + 1 + len(accepted)   # the root and the accepted path

    # ---- emit -----------------------------------------------------------------------------
    def _emit(self, plans: list[SeqPlan]) -> list[RequestOutput]:
        """Append, stop-check, publish, then finish or trim, one plan at a time in batch order.
        The step's block-manager changes all happen here, in that order: which of two equal
        blocks the prefix cache keeps, and the order blocks go back to the pool, depend on it."""
        return [out for plan in plans if (out := self._emit_one(plan)) is not None]

    def _emit_one(self, plan: SeqPlan) -> RequestOutput | None:
        if plan.fault is None:
            try:
                return self._emit_ok(plan)
            except Exception as e:   # noqa: BLE001 - this request's alone (its grammar, its stop strings)
                self._note_fault(plan, "emit", e)
        return self._fail(plan.request, plan.fault)

    def _emit_ok(self, plan: SeqPlan) -> RequestOutput | None:
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
            return self._finalize(req, added)
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

    def _fail(self, req: Request, e: Exception) -> RequestOutput:
        """End a request that failed alone: finish_reason "error", its blocks back to the pool."""
        req.error = RequestError.of(e)
        self.scheduler.finish(req, "error")
        return self._finalize(req)

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

    def _finalize(self, req: Request, added: list[int] | None = None) -> RequestOutput:
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
            prompt_logprobs=req.prompt_logprobs)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """Release the target's processes (the worker ranks under tensor parallelism) and the
        grammar compiler's."""
        self.grammars.close()
        self.target.close()
