"""The target made ready to serve, behind one call (`prepare`): the target opened on the CPUs other
processes leave free, its KV pool sized from the memory left after the load, its LoRA adapters and
the drafter built beside it, one forward at every verify size (the warm-up), the adaptive
controller's step costs timed (or read from this machine's cache, spec/curve_cache.py), and the
thread governor's check that fewer threads give the same bits. The engine then only schedules
and steps.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from drafters.base import Drafter
from drafters.config import SpecConfig
from drafters.kinds import build_drafter, default_speculation
from spec.adapters import Adapters
from spec.adaptive import AdaptiveConfig
from spec.config import EngineConfig
from spec.curve_cache import cached_curve, cached_thread_check
from spec.step_cost import CostCurve, StatedCost, StepCost
from spec.threads import ThreadGovernor, same_on_every_count
from verifier.batch import ForwardBatch, SeqInput
from verifier.block_manager import BlockManager, BlockManagerConfig
from verifier.cpu.cpus import CpuBudget, IdleMeter, cpu_budget, free_cpus
from verifier.cpu.machine import default_threads, on_threads
from verifier.memory import MemoryReport, available_bytes
from verifier.parallel import open_target
from verifier.target import TargetModel

log = logging.getLogger("tercel.engine")
CURVE_ROUNDS = 5        # timed forwards per row count for the adaptive controller's cost curve, at most
CURVE_BUDGET_S = 10.0   # seconds of timed rounds past the first: a 1.7B target's round takes seconds
CURVE_CONTEXT = 256     # tokens before the timed rows: about a chat request's context


@dataclass(frozen=True)
class Prepared:
    """A target ready to serve, and what was chosen for it at load."""
    target: TargetModel
    max_model_len: int
    blocks: BlockManager              # over the target's KV pool
    memory: MemoryReport              # measured after the pool was allocated
    adapters: Adapters
    drafter: Drafter | None
    spec_config: SpecConfig           # the drafter's tree (the engine's cap on a request's)
    cost: StepCost | None             # the adaptive controller's step costs (None: nothing to price)
    threads: ThreadGovernor
    num_threads: int                  # the most a step runs on
    cpu_budget: CpuBudget


def prepare(config: EngineConfig) -> Prepared:
    """Open `config.model` and make it ready to serve (the module's docstring)."""
    budget = cpu_budget()
    num_threads = config.num_threads or default_threads()
    # The load runs on the CPUs other processes leave free: beside a busy neighbour its
    # torch work on every CPU spent most of its time at barriers (docs/performance.md,
    # "Shared CPUs"). The kernel choices are timed on num_threads, the count they serve.
    with on_threads(free_cpus(num_threads)):
        # One TargetModel, or rank 0 of a tensor-parallel one: the engine runs once, on rank 0,
        # and every call it makes on the target reaches all ranks (verifier/parallel.py).
        target = open_target(config.model, config.tensor_parallel_size, device=config.device,
                             backend=config.attention_backend, quantization=config.quantization,
                             num_threads=num_threads)
        try:
            return _Preparation(target, config, num_threads, budget).run()
        except BaseException:
            target.close()     # a tensor-parallel target's workers must not outlive a failed load
            raise


class _Preparation:
    """The steps of `prepare` after the load, over one target."""

    def __init__(self, target: TargetModel, config: EngineConfig, num_threads: int, budget: CpuBudget):
        self.target, self.config, self.num_threads, self.cpu_budget = target, config, num_threads, budget
        mc = target.config
        self.max_model_len = min(config.max_model_len or min(mc.max_position, 8192), mc.max_position)
        if mc.sliding_window:
            log.info("sliding window of %d tokens: served up to %d tokens, where it equals full attention",
                     mc.sliding_window, self.max_model_len)

    def run(self) -> Prepared:
        config, target = self.config, self.target
        eager = target.graphs_refused(config.graphs, lora=bool(config.lora_modules))
        # padding rows of a bucketed step write to blocks of their own, past the block manager's
        scratch = 0 if eager else config.graphs.scratch_blocks(config.block_size)
        graph_bytes = 0 if eager else target.graph_bytes_estimate(config.graphs)
        num_blocks = config.num_kv_blocks or max(
            1, kv_pool_bytes(target, config.kv_cache_bytes, graph_bytes) // target.kv_bytes_per_block(config.block_size))
        target.allocate_kv(num_blocks + scratch, config.block_size)
        memory = target.memory()
        log.info("%s", memory.line())
        self.blocks = BlockManager(BlockManagerConfig(num_blocks, config.block_size, config.enable_prefix_cache))
        adapters = Adapters(target, config)
        self.drafter, self.spec_config = None, config.speculation or SpecConfig()
        if config.drafter:
            self.spec_config = config.speculation or default_speculation(config.drafter)
            self.drafter = build_drafter(config.drafter, target, self.spec_config)
            adapters.load_drafts(self.drafter)
        if eager is None:
            taps = self.drafter.capture_layers if self.drafter is not None else ()
            target.use_graphs(config.graphs, self.max_model_len, list(range(num_blocks, num_blocks + scratch)), taps)
        elif target.device.type == "cuda":
            log.info("every step runs eagerly: %s", eager)
        # The warm-up and the cost curve run on the CPUs left free while the target loaded (the
        # curve is rescaled per thread count as steps run: spec/step_cost.py).
        free = free_cpus(self.num_threads)
        with on_threads(free):
            self.warm_up()
            cost = self.step_cost(config.adaptive)
        return Prepared(target, self.max_model_len, self.blocks, memory, adapters, self.drafter, self.spec_config,
                        cost, self.thread_governor(free), self.num_threads, self.cpu_budget)

    def warm_up(self) -> None:
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

    def step_cost(self, adaptive: AdaptiveConfig) -> StepCost | None:
        """The adaptive controller's step costs: the curve `adaptive` states, kept as stated, or
        the one timed here and learned on. None without a drafter, with the controller off (whole
        trees: nothing to price), or without room to time."""
        if self.drafter is None or not adaptive.enabled:
            return None
        if adaptive.cost_curve is not None:
            return StatedCost(adaptive.cost_curve)
        curve = self.cost_curve()
        return StepCost(curve, adaptive.smoothing) if curve is not None else None

    def cost_curve(self) -> CostCurve | None:
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
                            lambda: self.time_curve(rows, tree, ctx))

    def time_curve(self, rows: list[int], tree: int, ctx: int) -> CostCurve:
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
                forward(n)                           # the batch sizes' first use (see warm_up)
            # Rounds over every count, the fastest of each: a neighbour's burst slows one
            # round, not one count (a median of 3 in a row timed 2 rows below 1). A round is
            # added while the rounds so far and one more stay within the budget.
            times = [[forward(n) for n in rows]]
            while len(times) < CURVE_ROUNDS and sum(map(sum, times)) + sum(times[0]) <= CURVE_BUDGET_S:
                times.append([forward(n) for n in rows])
        return CostCurve.measured({n: min(t[i] for t in times) * 1e3 for i, n in enumerate(rows)})

    def thread_governor(self, free: int) -> ThreadGovernor:
        """Steps may run on fewer threads while that is faster (spec/threads.py), on a CPU target
        of one process whose forward gives the same bits on every count (checked here). The first
        ones run on the `free` CPUs, those other processes left while the engine loaded."""
        config, tuning = self.config, self.config.thread_tuning
        adaptive = tuning.adaptive and self.num_threads > 1 and self.target.device.type == "cpu" \
            and config.tensor_parallel_size == 1
        if adaptive and not self.same_on_fewer_threads():
            log.warning("the forward's bits depend on the thread count here (or the KV pool is too small "
                        "to check): steps stay on %d threads", self.num_threads)
            adaptive = False
        governor = ThreadGovernor(self.num_threads, replace(tuning, adaptive=adaptive), IdleMeter(), IdleMeter(),
                                  start=free)
        log.info("CPU threads: %s; %s", self.threads_chosen(), "fewer while faster" if governor.active else "fixed")
        return governor

    def threads_chosen(self) -> str:
        if self.config.num_threads:
            return f"{self.num_threads} (configured)"
        if self.num_threads < self.cpu_budget.threads:
            return f"{self.num_threads} (torch's thread count, below the budget of {self.cpu_budget.describe()})"
        return self.cpu_budget.describe()

    def same_on_fewer_threads(self) -> bool:
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

        def check() -> bool:
            with self.target.one_layer_per_kind():       # each kernel on each shape: the bits' whole story
                return same_on_every_count(forward, counts)
        return cached_thread_check(self.target, counts, check)


def kv_pool_bytes(target: TargetModel, asked: int, graph_bytes: int = 0) -> int:
    """`asked`, or with less free than that after the load (and the CUDA graphs' `graph_bytes`),
    nine tenths of what is free: a CPU pool's pages are committed as they are written, and a pool
    past the memory would meet the OOM killer mid-request instead of a full pool's preemption; a
    GPU pool is allocated whole, before the graphs are captured."""
    if target.device.type == "cuda":
        free = torch.cuda.mem_get_info(target.device)[0] - graph_bytes
    else:
        free = available_bytes()
    if free is None or asked <= 0.9 * free:
        return asked
    log.warning("KV pool: %.2f GB asked, %.2f GB free after the load: %.2f GB", asked / 1e9, free / 1e9,
                0.9 * free / 1e9)
    return max(0, int(0.9 * free))
