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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from drafters.base import DraftRequest, Prediction
from drafters.config import SpecConfig
from drafters.prediction import PredictionDrafter, join_prediction
from spec.adapters import Adapters
from spec.adaptive import AdaptiveConfig, AdaptiveController, Candidate
from spec.batch_guard import BatchGuard
from spec.config import EngineConfig
from spec.constraints import MAX_FORCED, constrain, forced_proposal
from spec.curve_cache import cached_curve, cached_thread_check
from spec.detokenizer import IncrementalDetokenizer
from spec.faults import NO_TOKEN_ALLOWED, RequestError, RequestFault
from spec.prompt_logprobs import prompt_logprobs
from spec.rejection import accept_greedy, accept_tree
from spec.request import Request, RequestOutput
from spec.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from spec.stats import EngineLimits, EngineStats, PhaseTimes, ThreadSteps
from spec.step_cost import CostCurve, StatedCost, StepCost, StepSample
from spec.threads import ThreadGovernor, same_on_every_count
from verifier.attention.kv_cache import slot_of
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput
from verifier.block_manager import BlockManager, BlockManagerConfig
from verifier.cpu.cpus import IdleMeter, cpu_budget, free_cpus
from verifier.cpu.machine import default_threads, on_threads
from verifier.memory import available_bytes
from verifier.model.tokenizer import prompt_ids
from verifier.parallel import open_target
from verifier.sampling.grammar import GrammarBackend, apply_bitmask, few_allowed, sole_tokens
from verifier.sampling.logprobs import TokenLogprob, decided, row_logprob
from verifier.sampling.sampler import greedy_token, make_generator, sample_token, target_probs, transform_logits
from verifier.sampling.sampling_params import SamplingParams
from verifier.target import TargetModel, generation_eos_ids

if TYPE_CHECKING:
    from drafters.base import Proposal

log = logging.getLogger("tercel.engine")
CURVE_ROUNDS = 5        # timed forwards per row count for the adaptive controller's cost curve, at most
CURVE_BUDGET_S = 10.0   # seconds of timed rounds past the first: a 1.7B target's round takes seconds
CURVE_CONTEXT = 256     # tokens before the timed rows: about a chat request's context


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


@dataclass(eq=False)
class SeqPlan:
    """One scheduled sequence on its way through a step: `_draft` makes one per scheduled
    sequence, in the scheduler's order, which is also the forward's; each later phase fills
    in the fields it owns. A row is one new token of the forward, flattened over the batch."""
    seq: ScheduledSeq                   # schedule: the request, its new tokens and tree slots
    ctx_len: int = field(init=False)    # tokens in the KV cache when scheduled: the first new token's slot
    # A prompt chunk with more of the prompt after it: no logits, nothing sampled or emitted.
    mid_prefill: bool = field(init=False)
    proposal: Proposal | None = None    # draft: its tree (root = last token); None: prefill or plain decode
    # draft: nodes 1..forced of the proposal are the grammar's forced chain (jump-forward), the
    # drafter's tree (`drafted`) below it if the drafter drafts ahead, else nothing
    forced: int = 0
    drafted: Proposal | None = None     # draft: the drafter's own proposal, for its counters
    predicted: tuple[int, ...] = ()     # draft: the prediction's chain proposed below the forced tokens
    forced_accepted: int = 0            # accept: forced chain nodes accepted
    # draft: a constrained request's grammar bitmask per sampled row, int32 [rows, W]; None: no grammar
    masks: torch.Tensor | None = None
    # draft: per sampled row, the one token its mask allows, or -1: the rows with one get no
    # logits (the target picks that token with probability 1 whatever they are); None: no grammar
    sole: list[int] | None = None
    first_row: int = 0                  # verify: its first row; it owns rows first_row .. + num_rows
    # verify: a view of the forward's fp32 logits, a row per `logit_rows` entry: [tree nodes, V]
    # for a tree, [1, V] (the last token) for a plain decode step or a prompt's last chunk,
    # [0, V] mid-prompt; rows whose mask allows one token are left out.
    logits: torch.Tensor | None = None
    accepted: tuple[int, ...] = ()      # accept: a tree's accepted nodes, by depth (node j at slot ctx_len + j)
    # accept: tokens to append: a tree's accepted path + one corrected or bonus token, else one
    # sampled token; none mid-prompt
    tokens: list[int] = field(default_factory=list)
    # accept: per token of `tokens`, its logprob (a request that asks for them), else None
    logprobs: list | None = None
    # any phase: what failed for this request alone; later phases skip it and emit fails it
    fault: Exception | None = None

    def __post_init__(self):
        req = self.seq.request
        self.ctx_len = req.num_computed_tokens
        self.mid_prefill = self.ctx_len + self.seq.num_new_tokens < req.num_tokens

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def logit_rows(self) -> list[int]:
        """The sampled rows (tree nodes; 0: a plain step's token) that get logits."""
        rows = self.proposal.tree.num_nodes if self.proposal is not None else 1
        return [u for u in range(rows) if self.sole is None or self.sole[u] < 0]

    @property
    def is_prompt(self) -> bool:
        """A prompt chunk: no tree, more than one new token."""
        return self.proposal is None and self.seq.num_new_tokens > 1

    @property
    def num_rows(self) -> int:
        """New tokens in the forward: every tree node, else the scheduled tokens."""
        return self.proposal.tree.num_nodes if self.proposal is not None else self.seq.num_new_tokens

    @property
    def kept_rows(self) -> list[int] | range:
        """Rows whose KV the commit kept, at positions ctx_len, ctx_len + 1, ...: a tree's root
        and accepted path (after accept), every row otherwise."""
        if self.proposal is None:
            return range(self.first_row, self.first_row + self.num_rows)
        return [self.first_row] + [self.first_row + j for j in self.accepted]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.cpu_budget = cpu_budget()
        self.num_threads = config.num_threads or default_threads()      # the most a step runs on
        # The load runs on the CPUs other processes leave free: beside a busy neighbour its
        # torch work on every CPU spent most of its time at barriers (docs/performance.md,
        # "Shared CPUs"). The kernel choices are timed on num_threads, the count they serve.
        with on_threads(free_cpus(self.num_threads)):
            # One TargetModel, or rank 0 of a tensor-parallel one: the engine runs once, on rank 0,
            # and every call it makes on the target reaches all ranks (verifier/parallel.py).
            self.target: TargetModel = open_target(config.model, config.tensor_parallel_size, device=config.device,
                                                   backend=config.attention_backend, quantization=config.quantization,
                                                   num_threads=self.num_threads)
            try:
                self._set_up(config)
            except BaseException:
                self.target.close()     # a tensor-parallel target's workers must not outlive a failed load
                raise

    def _kv_pool_bytes(self, asked: int) -> int:
        """`asked`, or on a CPU with less free than that after the load, nine tenths of what is free:
        a CPU pool's pages are committed as they are written, and a pool past the memory would
        meet the OOM killer mid-request instead of a full pool's preemption."""
        free = available_bytes() if self.target.device.type == "cpu" else None
        if free is None or asked <= 0.9 * free:
            return asked
        log.warning("KV pool: %.2f GB asked, %.2f GB free after the load: %.2f GB", asked / 1e9, free / 1e9,
                    0.9 * free / 1e9)
        return int(0.9 * free)

    def _set_up(self, config: EngineConfig) -> None:
        self.tokenizer = self.target.tokenizer
        mc = self.target.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position, 8192), mc.max_position)
        if mc.sliding_window:
            log.info("sliding window of %d tokens: served up to %d tokens, where it equals full attention",
                     mc.sliding_window, self.max_model_len)
        num_blocks = config.num_kv_blocks or max(
            1, self._kv_pool_bytes(config.kv_cache_bytes) // self.target.kv_bytes_per_block(config.block_size))
        self.target.allocate_kv(num_blocks, config.block_size)
        self.memory = self.target.memory()
        self._memory_parts = tuple(self.memory.parts().items())     # for stats(), after every step
        log.info("%s", self.memory.line())
        self.blocks = BlockManager(BlockManagerConfig(num_blocks, config.block_size,
                                                      config.enable_prefix_cache))
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.blocks)
        self.adapters = Adapters(self.target, config)
        self.eos_ids = frozenset(mc.eos_token_ids) | set(generation_eos_ids(self.target.model_dir)) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.requests: dict[str, Request] = {}
        # Compiles `SamplingParams.structured`; xgrammar loads on the first constrained request.
        self.grammars = GrammarBackend(self.tokenizer, mc.vocab_size, sorted(self.eos_ids), config.grammar)
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self._pending: list[RequestOutput] = []
        self.drafter_errors = 0                 # drafter exceptions caught (requests decoded plainly)
        self._steps = self._last_step_tokens = 0  # forward steps so far, and the last one's tokens
        self._thread_steps: dict[int, ThreadSteps] = {}     # the same by the thread count they ran on
        self.drafter = None
        self.predictor = PredictionDrafter()   # drafts each request's own prediction, with or without a drafter
        self.adaptive = AdaptiveController(config.adaptive)    # its cost curve comes with the warm-up
        self.timing = PhaseTimes()      # the speculative steps' phases, cumulative
        self._propose_seconds = 0.0         # this step's drafter.propose
        self._drafting = 0                  # requests proposed for this step
        self._proposed = 0                  # draft nodes they proposed
        self.spec_config = config.speculation or SpecConfig()
        if config.drafter:
            from drafters.kinds import build_drafter, default_speculation
            self.spec_config = config.speculation or default_speculation(config.drafter)
            self.drafter = build_drafter(config.drafter, self.target, self.spec_config)
            self.adapters.load_drafts(self.drafter)
        # The warm-up and the cost curve run on the CPUs left free while the target loaded (the
        # curve is rescaled per thread count as steps run: spec/step_cost.py).
        free = free_cpus(self.num_threads)
        with on_threads(free):
            self._warm_up()
            self.adaptive.cost = self._step_cost(config.adaptive)
        # measured costs only: a stated curve pins the controller's choices, and so the guard's
        measured = self.adaptive.active and not isinstance(self.adaptive.cost, StatedCost)
        self.guard = BatchGuard(replace(config.adaptive.guard, enabled=config.adaptive.guard.enabled and measured))
        self._guarded: tuple[int, bool] | None = None     # this step's (decoding requests, may draft)
        self.threads = self._thread_governor(config, free)

    def _warm_up(self) -> None:
        """One target forward at each verify size, 1 to the largest tree, before serving.
        oneDNN builds a kernel on the first use of a shape (the first forward at a new size
        was much slower than the ones after it; figures: docs/performance.md, "Engine step"),
        which would slow the first requests and skew the adaptive controller's first
        measurements of speculation."""
        rows = 1 + (self.spec_config.max_nodes if self.drafter is not None else 0)
        if self.blocks.blocks_needed(None, rows) > self.blocks.num_free_blocks:
            return
        with self.blocks.scratch(-1, rows) as table:   # never published, not a request's lookup
            for n in range(1, rows + 1):
                self.target.forward(ForwardBatch([SeqInput([0] * n, 0, table, logits_indices=list(range(n)))]))

    def _step_cost(self, adaptive: AdaptiveConfig) -> StepCost | None:
        """The adaptive controller's step costs: the curve `adaptive` states, kept as stated, or
        the one timed here and learned on. None without a drafter, with the controller off (whole
        trees: nothing to price), or without room to time."""
        if self.drafter is None or not adaptive.enabled:
            return None
        if adaptive.cost_curve is not None:
            return StatedCost(adaptive.cost_curve)
        curve = self._cost_curve()
        return StepCost(curve, adaptive.smoothing) if curve is not None else None

    def _cost_curve(self) -> CostCurve | None:
        """The adaptive controller's cost curve: a verify forward timed at each tree size and
        at batches of trees, after a CURVE_CONTEXT-token prefix (each row's attention reads
        it, as a request's does), or as this machine timed it for a target of the same shapes
        (spec/curve_cache.py). None where the KV pool or the context has no room."""
        tree = 1 + self.spec_config.max_nodes
        widest = min(self.config.max_num_seqs * tree, self.config.max_num_batched_tokens)
        rows = list(range(1, tree + 1)) + [r for r in (tree * 2 ** i for i in range(1, 8)) if r < widest] \
            + [widest] * (widest > tree)
        ctx = max(0, min(CURVE_CONTEXT, self.max_model_len - widest - 1))
        if self.blocks.blocks_needed(None, ctx + widest) > self.blocks.num_free_blocks:
            return None
        return cached_curve(self.target, rows, ctx, self.config.block_size, CURVE_ROUNDS,
                            lambda: self._time_curve(rows, tree, ctx))

    def _time_curve(self, rows: list[int], tree: int, ctx: int) -> CostCurve:
        """The forward timed at each of `rows` after `ctx` tokens (the counts past `tree` are batches)."""
        widest = rows[-1]
        with self.blocks.scratch(-1, ctx + widest) as table:
            for start in range(0, ctx, self.config.max_num_batched_tokens):
                chunk = min(ctx - start, self.config.max_num_batched_tokens)
                self.target.forward(ForwardBatch([SeqInput([0] * chunk, start, table, logits_indices=[])]))

            def forward(n: int) -> float:
                began = time.perf_counter()
                self.target.forward(ForwardBatch([SeqInput([0] * n, ctx, table, logits_indices=list(range(n)))]))
                return time.perf_counter() - began
            for n in rows[tree:]:
                forward(n)                           # the batch sizes' first use (see _warm_up)
            # Rounds over every count, the fastest of each: a neighbour's burst slows one
            # round, not one count (a median of 3 in a row timed 2 rows below 1). A round is
            # added while the rounds so far and one more stay within the budget.
            times = [[forward(n) for n in rows]]
            while len(times) < CURVE_ROUNDS and sum(map(sum, times)) + sum(times[0]) <= CURVE_BUDGET_S:
                times.append([forward(n) for n in rows])
        return CostCurve.measured({n: min(t[i] for t in times) * 1e3 for i, n in enumerate(rows)})

    def _thread_governor(self, config: EngineConfig, free: int) -> ThreadGovernor:
        """Steps may run on fewer threads while that is faster (spec/threads.py), on a CPU target
        of one process whose forward gives the same bits on every count (checked here). The first
        ones run on the `free` CPUs, those other processes left while the engine loaded."""
        tuning = config.thread_tuning
        adaptive = tuning.adaptive and self.num_threads > 1 and self.target.device.type == "cpu" \
            and config.tensor_parallel_size == 1
        if adaptive and not self._same_on_fewer_threads():
            log.warning("the forward's bits depend on the thread count here (or the KV pool is too small "
                        "to check): steps stay on %d threads", self.num_threads)
            adaptive = False
        governor = ThreadGovernor(self.num_threads, replace(tuning, adaptive=adaptive), IdleMeter(), IdleMeter(),
                                  start=free)
        log.info("CPU threads: %s; %s", self._threads_chosen(config),
                 "fewer while faster" if governor.active else "fixed")
        return governor

    def _threads_chosen(self, config: EngineConfig) -> str:
        if config.num_threads:
            return f"{self.num_threads} (configured)"
        if self.num_threads < self.cpu_budget.threads:
            return f"{self.num_threads} (torch's thread count, below the budget of {self.cpu_budget.describe()})"
        return self.cpu_budget.describe()

    def _same_on_fewer_threads(self) -> bool:
        """A scratch prompt of 17 tokens (prompt rows in two of the kernels' 8-row passes and a
        partial one, then a sampled row) and a 3-token chain after it give the same logits on
        every thread count the governor may pick; checked once per machine and target shape
        (`spec.curve_cache.cached_thread_check`)."""
        prompt = 17
        rows = prompt + 3
        if self.blocks.blocks_needed(None, rows) > self.blocks.num_free_blocks:
            return False                # unchecked: not worth a risk to exactness
        tokens = torch.randint(0, self.target.config.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
        tokens = tokens.tolist()

        def forward() -> torch.Tensor:
            with self.blocks.scratch(-1, rows) as table:
                first = self.target.forward(ForwardBatch([SeqInput(tokens[:prompt], 0, table)]))
                chain = self.target.forward(ForwardBatch([SeqInput(tokens[prompt:], prompt, table,
                                                                   logits_indices=[0, 1, 2])]))
            return torch.cat([first.logits, chain.logits])
        counts = sorted({1, self.num_threads - 1, self.num_threads} - {0})
        return cached_thread_check(self.target, counts, lambda: same_on_every_count(forward, counts))

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
            speculating=on, draft_budget=self.adaptive.last_budget if on else 0, drafter_errors=self.drafter_errors,
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
        self._propose_seconds, self._drafting, self._proposed = 0.0, 0, 0
        start = time.perf_counter()
        sched = self._schedule()
        if sched.is_empty:
            return outputs
        plans = self._draft(sched)
        drafted = time.perf_counter()
        fwd = self._verify(plans)
        verified = time.perf_counter()
        self._drafter_prefill(plans)
        self._accept(plans)
        self._commit(plans)
        new = self._emit(plans)
        self._drafter_observe(plans, fwd)      # after emit: finished requests are skipped
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
        self.adaptive.cost.observe(StepSample(sum(p.num_rows for p in plans), decoding, self._drafting, nodes,
                                              prefill, forward_s, self._propose_seconds, total_s, self._proposed))

    def _observe_guard(self, plans: list[SeqPlan], prefill: bool, total_s: float) -> None:
        """A decode step's tokens and time, for the batch guard (prompt chunks' steps are not its)."""
        guarded, self._guarded = self._guarded, None
        if guarded is None or prefill:
            return
        tokens = sum(len(p.tokens) for p in plans)
        self.guard.observe(guarded[0], guarded[1], tokens, total_s)

    # ---- schedule -------------------------------------------------------------------------
    def _schedule(self) -> SchedulerOutput:
        """The adaptive controller caps each running request's tree, then the scheduler
        reserves each decoding request's tree slots (lookahead) with its tokens."""
        self._plan_drafts()
        sched = self.scheduler.schedule(lookahead=self._lookahead)
        for req in sched.preempted:
            self._release_draft(req)
        return sched

    def _plan_drafts(self) -> None:
        """Whether each decoding request drafts this step (`req.draft_cap` 0: it does not)."""
        if self.drafter is None:
            return
        running = self.scheduler.running
        decoding = [r for r in running if not r.in_prefill]
        chunk = self.config.max_num_batched_tokens
        base_rows = min(chunk, len(decoding) + sum(min(r.num_tokens - r.num_computed_tokens, chunk)
                                                   for r in running if r.in_prefill))
        prompt_rows = max(0, base_rows - len(decoding))
        chosen = [r for r in decoding if r.speculate and not self._pinned(r)]
        allowed = self.guard.speculates(len(decoding))
        # the guard learns from steps where it chose: none where every request decodes plainly anyway
        self._guarded = (len(decoding), allowed) if chosen else None
        for r in chosen:
            r.history = r.history or self.adaptive.history()
            drafts = allowed and self.adaptive.drafts(r.history, len(decoding), base_rows, prompt_rows=prompt_rows)
            r.draft_cap = self._nodes_to_draft(r, len(decoding), base_rows, prompt_rows) if drafts else 0

    def _nodes_to_draft(self, req: Request, decoding: int, base_rows: int, prompt_rows: int) -> int | None:
        """A drafter whose time grows per node drafts what the controller expects to pay (None: its tree)."""
        if not self.drafter.drafts_per_node:
            return None
        most = (req.speculation or self.spec_config).max_nodes
        return self.adaptive.nodes_to_draft(req.history, decoding, base_rows, most, prompt_rows=prompt_rows)

    @staticmethod
    def _pinned(req: Request) -> bool:
        """Seeded sampling reproduces only along one speculation path, so the adaptive
        controller (whose choices depend on timing) leaves seeded sampled requests their trees."""
        return req.params.seed is not None and not req.params.greedy

    # ---- draft ----------------------------------------------------------------------------
    def _lookahead(self, req: Request) -> int:
        """Tree slots a decoding request needs this step: its grammar's forced tokens if it
        forces any (jump-forward; `req.forced`, read by _draft), and the drafter's tree (below
        them: only a drafter that drafts ahead)."""
        req.forced, req.fault = [], None
        try:
            req.forced = self._forced(req)
        except Exception as e:   # this request's grammar: it fails alone, in emit
            req.fault = e
            return 0
        return len(req.forced) + max(self._drafter_nodes(req), self._prediction_depth(req))

    def _drafter_nodes(self, req: Request) -> int:
        """Draft nodes the drafter may propose this step: below forced tokens only if it drafts ahead."""
        ahead = not req.forced or (self.drafter is not None and self.drafter.drafts_ahead)
        return self._spec_limits(req)[1] if ahead else 0

    def _prediction_depth(self, req: Request) -> int:
        """The prediction's chain this step: as deep as the request's tree goes (γ), below its
        forced tokens, never past max_tokens or the context."""
        if req.prediction is None:
            return 0
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return max(0, min((req.speculation or self.spec_config).num_speculative_tokens, room - 1 - len(req.forced)))

    def _forced(self, req: Request) -> list[int]:
        if req.grammar is None or not self.config.jump_forward:
            return []
        # A step emits at most the forced tokens + 1: never past max_tokens or the context.
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return req.grammar.forced(min(MAX_FORCED, room - 1))

    def _spec_limits(self, req: Request) -> tuple[int, int, int]:
        """(max draft depth, max draft nodes, top-k) for a decoding request this step, below its
        forced tokens (`req.forced`); depth 0 = plain."""
        if self.drafter is None or not req.speculate:
            return 0, 0, 1
        spec = req.speculation or self.spec_config
        nodes = spec.max_nodes
        if not self._pinned(req) and req.draft_cap is not None:
            nodes = min(nodes, req.draft_cap)
        # A step emits at most forced + depth + 1 tokens: never draft past max_tokens or the context.
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        depth = min(spec.num_speculative_tokens, room - 1 - len(req.forced), nodes)
        if depth < 1:
            return 0, 0, 1
        return depth, nodes, spec.topk

    def _draft(self, sched: SchedulerOutput) -> list[SeqPlan]:
        """One plan per scheduled sequence; decoding requests given tree slots get a proposal."""
        plans = [SeqPlan(s) for s in sched.seqs]
        for plan in plans:
            plan.fault = plan.request.fault
        picked = [p for p in plans if p.seq.num_lookahead and not p.request.in_prefill and p.fault is None]
        for plan in picked:
            if plan.request.forced:
                plan.proposal = forced_proposal(plan.request.token_ids[-1], plan.request.forced)
                plan.forced = len(plan.request.forced)
        drafted = [p for p in picked if p.seq.num_lookahead > p.forced]
        proposed = [(p, prop) for p, prop in zip(drafted, self._proposals(drafted)) if prop is not None]
        drafted = [p for p, _ in proposed]
        props = self._trim(drafted, [prop for _, prop in proposed], plans)
        for plan, prop in zip(drafted, props):
            if prop is None:        # the adaptive controller kept none of it: a plain decode step
                continue
            plan.drafted = prop
            if not plan.forced:
                plan.proposal = prop
            elif prop.draft is None:        # point masses below the chain (drafts_ahead drafters)
                plan.proposal = forced_proposal(plan.request.token_ids[-1], plan.request.forced, prop.tree)
        constrained = [p for p in plans if p.request.grammar is not None and not p.mid_prefill]
        self._each(constrained, "constrain", self._constrain)
        return plans

    def _trim(self, drafted: list[SeqPlan], props: list["Proposal"], plans: list[SeqPlan]) -> list:
        """The proposals cut to the draft nodes the adaptive controller verifies (None where it
        keeps none, or the drafter proposed none: a plain decode step, without a tree's mask
        and acceptance). A request below a forced chain or a pinned one keeps its whole
        proposal, a bare root included (its draws follow the tree path)."""
        if not props:
            return []
        free = [not plan.forced and not self._pinned(plan.request) for plan in drafted]
        props = [None if f and not prop.num_draft_nodes else prop for f, prop in zip(free, props)]
        cut = [i for i, (f, plan, prop) in enumerate(zip(free, drafted, props))
               if f and prop is not None and plan.request.history is not None]
        others = [i for i in set(range(len(drafted))) - set(cut) if props[i] is not None]
        base_rows = sum(p.num_rows for p in plans if p not in drafted) + len(cut) \
            + sum(drafted[i].forced + props[i].num_draft_nodes for i in others)
        decoding = sum(1 for p in plans if not p.mid_prefill)
        # a prompt chunk's rows, less the row a finishing prompt samples its first token from
        prompt_rows = sum(p.num_rows - (not p.mid_prefill) for p in plans if p not in drafted and p.is_prompt)
        keep = self.adaptive.trim([self._candidate(drafted[i].request, props[i]) for i in cut], decoding, base_rows,
                                  prompt_rows=prompt_rows)
        out = list(props)
        for i, k in zip(cut, keep):
            out[i] = props[i].truncated(k) if k else None
        return out

    @staticmethod
    def _candidate(req: Request, prop: "Proposal") -> Candidate:
        """A sampled proposal's scores are left out: they would depend on what was drawn, and a
        cut that reads the draws changes the law the nodes came from (rank alone is safe)."""
        scores = prop.scores if prop.draft is None else None
        return Candidate(req.history, prop.tree.depths[1:], scores, prop.score_kind)

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

    def _proposals(self, drafted: list[SeqPlan]) -> list["Proposal | None"]:
        """Per plan, the drafter's proposal joined with its request's prediction chain; None
        where there is neither (the drafter failed: a plain decode step)."""
        reqs = [p.request for p in drafted if self._drafter_nodes(p.request)]
        own = dict(zip((r.seq_id for r in reqs), self._propose(reqs)))    # empty if the drafter failed
        return [self._with_prediction(p, own.get(p.request.seq_id)) for p in drafted]

    def _with_prediction(self, plan: SeqPlan, own: "Proposal | None") -> "Proposal | None":
        """The request's prediction chain joined with the drafter's proposal `own` (drafters/prediction.py)."""
        req = plan.request
        if req.prediction is None:
            return own
        depth = self._prediction_depth(req)
        view = DraftRequest(req.seq_id, req.token_ids + req.forced, req.params, req.generator, depth, depth,
                            unverified=len(req.forced), num_prompt=req.num_prompt_tokens, prediction=req.prediction)
        try:
            chain = self.predictor.propose([view])[0]
        except Exception:  # a bug here must not fail the request: the drafter's proposal alone
            self.drafter_errors += 1
            log.exception("drafting the prediction of seq %d failed", req.seq_id)
            return own
        plan.predicted = chain.tree.tokens[1:]
        return join_prediction(chain, own, max(self._drafter_nodes(req), depth))

    def _propose(self, reqs: list[Request]) -> list["Proposal"]:
        """The drafter's trees for reqs, in order; none at all (plain decoding) if it raises."""
        if not reqs:
            return []
        views = [DraftRequest(r.seq_id, r.token_ids + r.forced, r.params, r.generator, *self._spec_limits(r),
                              unverified=len(r.forced), num_prompt=r.num_prompt_tokens, prediction=r.prediction,
                              held_back=self._held_back(r.params), adapter=self.adapters.name(r.adapter))
                 for r in reqs]
        start = time.perf_counter()
        try:
            props = self.drafter.propose(views)
            self._propose_seconds, self._drafting = time.perf_counter() - start, len(views)
            self._proposed = sum(p.num_draft_nodes for p in props)
        except Exception:  # a drafter bug must not fail requests: decode plainly this step
            self.drafter_errors += 1
            log.exception("drafter %s failed; decoding %d requests plainly this step",
                          self.drafter.name, len(views))
            return []
        for view, prop in zip(views, props):
            if prop.tree.tokens[0] != view.token_ids[-1] or prop.num_draft_nodes > view.max_nodes:
                raise AssertionError(f"drafter {self.drafter.name} broke its contract for seq {view.seq_id}")
        return props

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

    def _drafter_prefill(self, plans: list[SeqPlan]) -> None:
        """Hand the drafter the prompt chunks the target just ran, for its own KV."""
        if self.drafter is None:
            return
        from drafters.base import PrefillChunk
        chunks = [PrefillChunk(p.request.seq_id, p.request.token_ids, p.ctx_len,
                               p.ctx_len + p.seq.num_new_tokens, self.adapters.name(p.request.adapter))
                  for p in plans if p.is_prompt and p.request.speculate and p.fault is None]
        if chunks:
            try:
                self.drafter.prefill(chunks)
            except Exception:   # the drafter catches up later from its own bookkeeping
                self.drafter_errors += 1
                log.exception("drafter %s failed to prefill", self.drafter.name)

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
                    self.adaptive.observe(self._candidate(req, plan.proposal), plan.accepted)
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

    def _drafter_observe(self, plans: list[SeqPlan], fwd: ForwardOutput) -> None:
        """Hand the tapped hidden states of kept positions to a feature-reading drafter."""
        if self.drafter is None or not self.drafter.capture_layers or fwd is None:
            return
        from drafters.base import TargetHidden
        live = [p for p in plans if p.request.speculate and not p.request.finished]
        if not live:
            return
        rows = [p.kept_rows for p in live]
        # [new tokens, sum of tapped widths]: rows as laid out by _verify
        hidden = torch.cat([fwd.hidden[layer] for layer in self.drafter.capture_layers], dim=-1)
        index = torch.tensor([r for rs in rows for r in rs], device=hidden.device)
        parts = hidden.index_select(0, index).split([len(rs) for rs in rows])
        try:
            self.drafter.observe([TargetHidden(p.request.seq_id, p.ctx_len, h) for p, h in zip(live, parts)])
        except Exception:   # a drafter bug must not fail requests
            self.drafter_errors += 1
            log.exception("drafter %s failed to observe target states", self.drafter.name)

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

    def _drafter_learns(self, req: Request) -> None:
        """Hand a finished output to the drafter; a drafter bug must not fail the request."""
        if self.drafter is None:
            return
        try:
            self.drafter.finish(req.seq_id, req.token_ids, req.num_prompt_tokens)
        except Exception:
            self.drafter_errors += 1
            log.exception("drafter %s failed to learn seq %d's output", self.drafter.name, req.seq_id)

    def _release_draft(self, req: Request) -> None:
        self.predictor.release(req.seq_id)
        if self.drafter is not None:
            self.drafter.release(req.seq_id)

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
        self._drafter_learns(req)
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
