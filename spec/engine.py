"""The engine: requests in, one step at a time, outputs out.

One step: schedule -> draft (a token tree per decoding request) -> verify (one target
forward over prefill chunks and every tree) -> accept (exact rejection sampling) ->
commit (move accepted KV into place, publish full blocks to the prefix cache) -> emit
(detokenize, stop checks). Plain decoding is the same loop without a drafter.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from drafters.config import SpecConfig
from spec.adaptive import AdaptiveController
from spec.config import EngineConfig
from spec.detokenizer import IncrementalDetokenizer
from spec.rejection import accept_greedy, accept_tree
from spec.request import Request, RequestOutput
from spec.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.block_manager import BlockManager, BlockManagerConfig
from verifier.kernels import engine_rows
from verifier.kv_cache import slot_of
from verifier.sampler import apply_penalties, greedy_token, make_generator, sample_token, target_probs
from verifier.sampling_params import SamplingParams
from verifier.target import TargetModel

if TYPE_CHECKING:
    from drafters.base import Proposal

log = logging.getLogger("tercel.engine")


@dataclass
class StepTiming:
    """Wall time of speculative steps, split into their phases (benchmarks read it)."""
    steps: int = 0
    draft_seconds: float = 0.0      # schedule + drafter.propose
    verify_seconds: float = 0.0     # the target forward over prefill chunks and trees
    accept_seconds: float = 0.0     # acceptance, KV commit, emit, drafter bookkeeping

    def add(self, draft: float, verify: float, accept: float) -> None:
        self.steps += 1
        self.draft_seconds += draft
        self.verify_seconds += verify
        self.accept_seconds += accept


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.target = TargetModel(config.model, device=config.device, backend=config.attention_backend,
                                  quantization=config.quantization,
                                  kernel_rows=engine_rows(config.max_num_batched_tokens))
        self.tokenizer = self.target.tokenizer
        mc = self.target.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position, 8192), mc.max_position)
        num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_bytes // self.target.kv_bytes_per_block(config.block_size))
        self.target.allocate_kv(num_blocks, config.block_size)
        self.blocks = BlockManager(BlockManagerConfig(num_blocks, config.block_size,
                                                      config.enable_prefix_cache))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.blocks)
        self.eos_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.requests: dict[str, Request] = {}
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self._pending: list[RequestOutput] = []
        self.drafter_errors = 0                 # drafter exceptions caught (requests decoded plainly)
        self.drafter = None
        timings = self.target.kernel_timings      # decode rows run on the quantization's own kernel
        self.adaptive = AdaptiveController(config.adaptive, timings.rows_before_cliff(self.target.quantization)
                                           if timings is not None else None)
        self._spec_on = False
        self._draft_cap: int | None = None    # draft nodes per request this step (None: no cap)
        self.timing = StepTiming()
        self.spec_config = config.speculation or SpecConfig()
        if config.drafter:
            from drafters.base import build_drafter, default_speculation
            self.spec_config = config.speculation or default_speculation(config.drafter)
            self.drafter = build_drafter(config.drafter, self.target, self.spec_config)
        self._warm_up()
        # Everything loaded so far lives as long as the engine: move it out of the cyclic
        # GC's reach. Otherwise a full collection (triggered by allocation-heavy steps such
        # as n-gram indexing of a long prompt) walks every object of the process: measured
        # in a 518k-object pytest process, tiny model, n-gram on a 660-token rag prompt,
        # 67 tok/s with the collector on against 455 with it off (about 14 ms per step).
        gc.collect()
        gc.freeze()

    def _warm_up(self) -> None:
        """One target forward at each verify size, 1 to the largest tree, before serving.
        oneDNN builds a kernel on the first use of a shape (SmolLM2, 2 threads: the first
        3-token forward took 73 ms, the 4- to 6-token forwards after it 30-34 ms), which
        would slow the first requests and skew the adaptive controller's first measurements
        of speculation."""
        rows = 1 + (self.spec_config.max_nodes if self.drafter is not None else 0)
        seq_id = -1                                   # never a request's id
        tokens = [0] * rows
        if not self.blocks.can_allocate(tokens):
            return
        counters = self.blocks.prefix_queries, self.blocks.prefix_hits
        self.blocks.allocate(seq_id, tokens)
        try:
            table = self.blocks.block_table(seq_id)
            for n in range(1, rows + 1):
                self.target.forward(ForwardBatch([SeqInput(tokens[:n], 0, table, logits_indices=list(range(n)))]))
        finally:
            self.blocks.free(seq_id)           # never published: the blocks go back free
            self.blocks.prefix_queries, self.blocks.prefix_hits = counters   # not a request's lookup

    # ---- requests in ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"] if prompt else []
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, speculate: bool = True,
                    speculation: SpecConfig | None = None) -> Request:
        """Validate and queue; ValueError (naming the problem) leaves no state behind.
        `speculate=False` decodes this request plainly; `speculation` caps its tree (depth,
        top-k, budget) below the engine's own SpecConfig."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate(ids, params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        req = Request(request_id, ids, params,
                      IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens),
                      prompt=prompt if isinstance(prompt, str) else None,
                      generator=make_generator(seed, self.target.device))
        req.speculate = speculate
        req.speculation = self._cap_speculation(speculation)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _cap_speculation(self, spec: SpecConfig | None) -> SpecConfig | None:
        if spec is None:
            return None
        top = self.spec_config
        for name, mine, cap in (("gamma", spec.num_speculative_tokens, top.num_speculative_tokens),
                                ("topk", spec.topk, top.topk), ("budget", spec.max_nodes, top.max_nodes)):
            if mine > cap:
                raise ValueError(f"speculation {name} {mine} exceeds the server's limit {cap}")
        return spec

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt and these params can never run here (read-only)."""
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.target.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length max_model_len={self.max_model_len}")
        # Tree verification needs room for the draft nodes on top of the tokens themselves.
        slots = total + (self.spec_config.max_nodes if self.drafter is not None else 0)
        if self.blocks.blocks_needed(None, slots) > self.blocks.num_total_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs more KV blocks than the "
                             f"pool has ({self.blocks.num_total_blocks} of {self.blocks.block_size})")

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self._finalize(req))

    @property
    def draft_budget(self) -> int:
        """Draft nodes a request may propose in the last step (the adaptive cap, if any)."""
        return self._capped(self.spec_config.max_nodes)

    def _capped(self, max_nodes: int) -> int:
        return max_nodes if self._draft_cap is None else min(max_nodes, self._draft_cap)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        start = time.perf_counter()
        running = len(self.scheduler.running)
        self._spec_on = self.drafter is not None and self.adaptive.enabled(running)
        self._draft_cap = self.adaptive.draft_budget(running)
        sched = self.scheduler.schedule(lookahead=lambda req: self._spec_limits(req)[1])
        for req in sched.preempted:
            self._release_draft(req)
        if sched.is_empty:
            return outputs
        proposals = self._draft(sched)
        drafted = time.perf_counter()
        fwd = self.target.forward(self._forward_batch(sched, proposals))
        verified = time.perf_counter()
        self._drafter_prefill(sched, proposals)
        kept: list[tuple[int, int, range | list[int]]] = []
        new = self._postprocess(sched, proposals, fwd, kept)
        self._drafter_observe(fwd, kept)
        end = time.perf_counter()
        if proposals:
            self.timing.add(drafted - start, verified - drafted, end - verified)
        self._observe(sched, new, proposals, end - start)
        return outputs + new

    def _observe(self, sched: SchedulerOutput, new: list[RequestOutput], proposals: dict, seconds: float) -> None:
        """Feed pure decode steps to the adaptive controller (prefill work would skew the rate)."""
        if self.drafter is None or any(s.num_new_tokens > 1 for s in sched.seqs):
            return
        emitted = sum(len(o.delta_token_ids) for o in new)
        self.adaptive.observe(bool(proposals), len(sched.seqs), emitted / len(sched.seqs), seconds)

    # ---- draft ----------------------------------------------------------------------------
    def _spec_limits(self, req: Request) -> tuple[int, int, int]:
        """(max draft depth, max draft nodes, top-k) for a decoding request this step; depth 0 = plain."""
        # Seeded sampling reproduces only along one speculation path, so adaptive switching
        # (which depends on load and timing) leaves seeded sampled requests speculating.
        pinned = req.params.seed is not None and not req.params.greedy
        if self.drafter is None or not req.speculate or not (self._spec_on or pinned):
            return 0, 0, 1
        spec = req.speculation or self.spec_config
        # The adaptive controller shrinks trees as the batch grows (not a pinned request's:
        # its draws depend on the tree).
        nodes = spec.max_nodes if pinned else self._capped(spec.max_nodes)
        # A step emits at most depth + 1 tokens: never draft past max_tokens or the context.
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        depth = min(spec.num_speculative_tokens, room - 1, nodes)
        if depth < 1:
            return 0, 0, 1
        return depth, nodes, spec.topk

    def _draft(self, sched: SchedulerOutput) -> dict[int, "Proposal"]:
        from drafters.base import DraftRequest
        picked = [(i, s.request) for i, s in enumerate(sched.seqs)
                  if s.num_lookahead and not s.request.in_prefill]
        if not picked:
            return {}
        views = [DraftRequest(r.seq_id, r.token_ids, r.params, r.generator, *self._spec_limits(r))
                 for _, r in picked]
        try:
            props = self.drafter.propose(views)
        except Exception:  # a drafter bug must not fail requests: decode plainly this step
            self.drafter_errors += 1
            log.exception("drafter %s failed; decoding %d requests plainly this step",
                          self.drafter.name, len(views))
            return {}
        for (_, req), prop in zip(picked, props):
            if prop.tree.tokens[0] != req.token_ids[-1] or prop.num_draft_nodes > self._spec_limits(req)[1]:
                raise AssertionError(f"drafter {self.drafter.name} broke its contract for {req.request_id}")
        return {i: p for (i, _), p in zip(picked, props)}

    def _drafter_prefill(self, sched: SchedulerOutput, proposals: dict) -> None:
        if self.drafter is None:
            return
        from drafters.base import PrefillChunk
        chunks = [PrefillChunk(s.request.seq_id, s.request.token_ids, s.request.num_computed_tokens,
                               s.request.num_computed_tokens + s.num_new_tokens)
                  for i, s in enumerate(sched.seqs)
                  if i not in proposals and s.request.speculate and s.num_new_tokens > 1]
        if chunks:
            try:
                self.drafter.prefill(chunks)
            except Exception:   # the drafter catches up later from its own bookkeeping
                self.drafter_errors += 1
                log.exception("drafter %s failed to prefill", self.drafter.name)

    def _drafter_observe(self, fwd: ForwardOutput, kept: list) -> None:
        """Hand the tapped hidden states of kept positions to a feature-reading drafter."""
        if self.drafter is None or not self.drafter.capture_layers:
            return
        from drafters.base import TargetHidden
        kept = [(req, start, rows) for req, start, rows in kept if req.speculate and not req.finished]
        if not kept:
            return
        hidden = torch.cat([fwd.hidden[layer] for layer in self.drafter.capture_layers], dim=-1)
        index = torch.tensor([r for _, _, rows in kept for r in rows], device=hidden.device)
        parts = hidden.index_select(0, index).split([len(rows) for _, _, rows in kept])
        try:
            self.drafter.observe([TargetHidden(req.seq_id, start, h) for (req, start, _), h in zip(kept, parts)])
        except Exception:   # a drafter bug must not fail requests
            self.drafter_errors += 1
            log.exception("drafter %s failed to observe target states", self.drafter.name)

    def _forward_batch(self, sched: SchedulerOutput, proposals: dict) -> ForwardBatch:
        seqs = []
        for i, s in enumerate(sched.seqs):
            req, start = s.request, s.request.num_computed_tokens
            table = self.blocks.block_table(req.seq_id)
            if i in proposals:
                tree = proposals[i].tree       # root at slot `start`, node j at start + j
                seqs.append(SeqInput(list(tree.tokens), start, table, positions=tree.positions(start),
                                     mask=tree.ancestor_mask(), logits_indices=list(range(tree.num_nodes))))
                continue
            end = start + s.num_new_tokens
            seqs.append(SeqInput(req.token_ids[start:end], start, table,
                                 logits_indices=None if end == req.num_tokens else []))
        return ForwardBatch(seqs, capture_layers=self.drafter.capture_layers if self.drafter else ())

    # ---- accept, commit, emit -------------------------------------------------------------
    def _postprocess(self, sched: SchedulerOutput, proposals: dict, fwd: ForwardOutput,
                     kept: list) -> list[RequestOutput]:
        """Accept, commit and emit; appends (request, first position, forward rows) of every
        position whose KV was kept to `kept`, for drafters that read target hidden states."""
        outputs, row = [], 0
        for i, s in enumerate(sched.seqs):
            req, start = s.request, s.request.num_computed_tokens
            first = row          # this sequence's first row among the forward's new tokens
            row += proposals[i].tree.num_nodes if i in proposals else s.num_new_tokens
            if i in proposals:
                tokens, accepted = self._accept_and_commit(req, proposals[i], fwd.seq_logits(i))
                kept.append((req, start, [first] + [first + j for j in accepted]))
            else:
                kept.append((req, start, range(first, row)))
                req.num_computed_tokens += s.num_new_tokens
                if req.num_computed_tokens < req.num_tokens:   # a prefill chunk, not the last
                    self.blocks.publish(req.seq_id, req.token_ids, req.num_computed_tokens)
                    continue
                tokens = [sample_token(fwd.seq_logits(i)[-1], req.params, req.prompt_token_ids,
                                       req.output_token_ids, req.generator)]
            added, reason = self._append_tokens(req, tokens)
            if i in proposals and proposals[i].num_draft_nodes:
                req.spec.emitted_tokens += len(added)
            # Publish before a finish frees the blocks: the next turn of a chat reuses them.
            self.blocks.publish(req.seq_id, req.token_ids, min(req.num_computed_tokens, req.num_tokens))
            if reason:
                self.scheduler.finish(req, reason)
                outputs.append(self._finalize(req, added))
            else:
                self.blocks.truncate(req.seq_id, req.num_computed_tokens)   # drop rejected tree slots
                outputs.append(self._output(req, added))
        return outputs

    def _accept_and_commit(self, req: Request, prop, logits: torch.Tensor) -> tuple[list[int], tuple[int, ...]]:
        """Exact acceptance over the verified tree; returns the tokens to emit and the
        accepted tree nodes."""
        tree, p = prop.tree, req.params
        prompt, output = req.prompt_token_ids, req.output_token_ids

        def node_logits(u: int) -> torch.Tensor:
            # Penalties see every token up to node u: the output so far plus u's path below the root.
            return apply_penalties(logits[u], p, prompt, output + tree.path_tokens(u)[1:])

        if p.greedy:
            result = accept_greedy(tree, lambda u: greedy_token(node_logits(u)))
        else:
            result = accept_tree(tree, lambda u: target_probs(node_logits(u)[None], p)[0],
                                 prop.draft, req.generator)
        self._commit_kv(req, result.accepted)
        self._count(req, prop, result.accepted)
        return [tree.tokens[j] for j in result.accepted] + [result.token], result.accepted

    def _commit_kv(self, req: Request, accepted: tuple[int, ...]) -> None:
        """Accepted node j (verified at slot ctx + j) moves to slot ctx + depth; the rest is dropped."""
        ctx, table, bs = req.num_computed_tokens, self.blocks.block_table(req.seq_id), self.blocks.block_size
        moves = [(slot_of(table, ctx + j, bs), slot_of(table, ctx + d, bs))
                 for d, j in enumerate(accepted, start=1) if j != d]
        if moves:
            self.target.kv.copy_slots([m[0] for m in moves], [m[1] for m in moves])
        req.num_computed_tokens = ctx + 1 + len(accepted)   # the root and the accepted path

    @staticmethod
    def _count(req: Request, prop, accepted: tuple[int, ...]) -> None:
        """Verify steps with at least one draft node (a bare root is a plain decode step)."""
        if not prop.num_draft_nodes:
            return
        st = req.spec
        st.verify_steps += 1
        st.draft_tokens += prop.num_draft_nodes
        st.accepted_tokens += len(accepted)
        while len(st.accepted_per_depth) < prop.tree.max_depth:
            st.accepted_per_depth.append(0)
        for d in range(len(accepted)):
            st.accepted_per_depth[d] += 1

    def _release_draft(self, req: Request) -> None:
        if self.drafter is not None:
            self.drafter.release(req.seq_id)

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append tokens one by one until one finishes the request (a stop inside an accepted
        path discards the rest). Returns the tokens added and the finish reason, if any."""
        added = []
        for t in tokens:
            req.token_ids.append(t)
            added.append(t)
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
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finalize(self, req: Request, added: list[int] | None = None) -> RequestOutput:
        self._release_draft(req)
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
            num_cached_tokens=req.num_cached_prompt_tokens, stats=req.spec)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
