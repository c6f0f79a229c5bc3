"""The engine seen from outside: what it accepts (`EngineLimits`, fixed once it is loaded)
and what it is doing (`EngineStats`, a snapshot between two steps).

Both are frozen values, so a reader on another thread (the server's event loop, a benchmark,
a metrics exporter) holds a consistent copy and never touches the engine's scheduler, block
pool or adaptive controller, which only the thread that steps the engine may use.
"""
from __future__ import annotations

from dataclasses import dataclass

from drafters.base import Prediction
from drafters.config import SpecConfig
from verifier.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of a loaded engine. Nothing here changes after the load, so a
    server may check requests against it on its own thread, before they queue."""
    max_model_len: int          # prompt + output tokens per request (the model's and the config's)
    max_num_seqs: int           # requests decoding together; more wait in the queue
    vocab_size: int             # prompt token ids must be below it
    kv_block_size: int          # tokens per KV block
    kv_blocks_total: int        # blocks in the pool: a request that needs more can never run
    drafter: str | None         # the drafter as configured ("ngram", "eagle3:PATH"); None: plain decoding
    speculation: SpecConfig     # the widest tree a request may draft (its own choice is capped by it)

    @property
    def tree_slots(self) -> int:
        """KV slots a verify step needs beyond a request's own tokens (its draft nodes)."""
        return self.speculation.max_nodes if self.drafter else 0

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) if this prompt and these params can never run."""
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")
        marks = () if params.thinking is None else (*params.thinking.end_ids, *(params.thinking.start_ids or ()))
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in marks):
            raise ValueError(f"the thinking budget's marker ids must be ints in [0, {self.vocab_size})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length max_model_len={self.max_model_len}")
        # Tree verification needs room for the draft nodes on top of the tokens themselves.
        if -(-(total + self.tree_slots) // self.kv_block_size) > self.kv_blocks_total:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs more KV blocks than the "
                             f"pool has ({self.kv_blocks_total} of {self.kv_block_size})")

    def validate_prediction(self, ids: list[int], params: SamplingParams, prediction: Prediction) -> None:
        """Raise ValueError (naming `prediction`) if this request's prediction can never be drafted."""
        if not isinstance(prediction, Prediction):
            raise ValueError(f"prediction must be a Prediction, got {type(prediction).__name__}")
        n = len(prediction.token_ids)
        if n > self.max_model_len:
            raise ValueError(f"prediction is {n} tokens, more than the context length "
                             f"max_model_len={self.max_model_len}")
        if any(t >= self.vocab_size for t in prediction.token_ids):
            raise ValueError(f"prediction token ids must be in [0, {self.vocab_size})")
        # Without a drafter its chain (γ deep) is the tree; with one it fits in the drafter's nodes.
        chain = self.tree_slots or self.speculation.num_speculative_tokens
        total = len(ids) + params.max_tokens + chain
        if -(-total // self.kv_block_size) > self.kv_blocks_total:
            raise ValueError(f"prompt + max_tokens + a prediction chain of {chain} = {total} tokens needs more KV "
                             f"blocks than the pool has ({self.kv_blocks_total} of {self.kv_block_size})")


@dataclass(frozen=True)
class PhaseTimes:
    """Wall time of the speculative steps so far, by phase (cumulative; subtract two snapshots
    for the steps in between)."""
    steps: int = 0
    draft_seconds: float = 0.0      # schedule + drafter.propose
    verify_seconds: float = 0.0     # the target forward over prefill chunks and trees
    accept_seconds: float = 0.0     # acceptance, KV commit, emit, drafter bookkeeping

    def plus(self, draft: float, verify: float, accept: float) -> PhaseTimes:
        """These times with one more step's phases added."""
        return PhaseTimes(self.steps + 1, self.draft_seconds + draft, self.verify_seconds + verify,
                          self.accept_seconds + accept)

    def __sub__(self, earlier: PhaseTimes) -> PhaseTimes:
        return PhaseTimes(self.steps - earlier.steps, self.draft_seconds - earlier.draft_seconds,
                          self.verify_seconds - earlier.verify_seconds, self.accept_seconds - earlier.accept_seconds)


@dataclass(frozen=True)
class ThreadSteps:
    """The steps that ran on one thread count and their wall seconds (where the governor's
    choices spent the time; spec/threads.py)."""
    threads: int
    steps: int = 0
    seconds: float = 0.0

    def plus(self, seconds: float) -> "ThreadSteps":
        return ThreadSteps(self.threads, self.steps + 1, self.seconds + seconds)


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps. Counters are cumulative since the load (all zero: an
    engine that has done nothing yet)."""
    running: int = 0                # requests holding KV blocks
    waiting: int = 0                # requests queued for admission (preempted ones included)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0         # free or evictable (cached, unused): both can be handed out now
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # prompt tokens served from it
    speculating: bool = False       # a drafter is set and the adaptive controller's last decision was on
    draft_budget: int = 0           # draft nodes a request could propose in the last step; 0 while not speculating
    drafter_errors: int = 0         # drafter exceptions caught (those requests decoded plainly)
    # (batch size, whether speculation leads there) per size the batch guard decided for (spec/batch_guard.py)
    batch_guard: tuple[tuple[int, bool], ...] = ()
    preemptions: int = 0            # running requests sent back to the queue for want of KV blocks
    threads: int = 0                # CPU threads steps run on now (outside the governor's probes)
    max_threads: int = 0            # the most they may: the configured count or the CPU budget
    thread_switches: int = 0        # times the thread governor changed the count (spec/threads.py)
    thread_steps: tuple[ThreadSteps, ...] = ()   # by thread count, ascending
    steps: int = 0                  # engine steps that ran a forward
    last_step_tokens: int = 0       # tokens the last of them ran (prompt chunks, decode tokens, tree nodes)
    timing: PhaseTimes = PhaseTimes()
    memory: tuple[tuple[str, int], ...] = ()   # bytes by part at load (verifier/memory.py:MemoryReport.parts)
    # LoRA adapters: the most served at once, and the names of those running and waiting requests run under
    max_loras: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()

    @property
    def kv_blocks_used(self) -> int:
        """Blocks referenced by requests."""
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def idle(self) -> bool:
        """No request queued or running."""
        return self.running == 0 and self.waiting == 0
