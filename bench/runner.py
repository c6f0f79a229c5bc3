"""Run one benchmark unit: one configuration (cell) on one task's prompts, batch 1.

Each prompt's turns run in order, each later turn after the model's own answer to the one
before (MT-bench's second turn). Prompts are seeded by position, so stochastic cells draw
the same way in every repeat. A Tercel cell gets a fresh engine (cold prefix cache, like
the plain engine it is compared with); HF baselines reuse one loaded model.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from bench.data import BenchPrompt
from bench.grid import Cell
from bench.stats import add_depths
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig


@dataclass(frozen=True)
class RunSettings:
    model: str
    max_tokens: int = 128
    ignore_eos: bool = False
    seed: int = 0
    adaptive: bool = False       # speculate as `tercel serve` does: only while it pays, trees sized to the step
    tensor_parallel_size: int = 1  # Tercel's target over this many devices (LLM(tensor_parallel_size=...))
    lora: tuple[str, str] | None = None   # (name, folder): every request runs under this LoRA adapter


@dataclass
class Turn:
    """One generated reply: what the runner needs from any engine."""
    token_ids: list[int]
    text: str
    ttft: float
    verify_steps: int = 0
    emitted_tokens: int = 0
    draft_tokens: int = 0
    accepted_per_depth: tuple[int, ...] = ()


class Generator(Protocol):
    def generate(self, prompt_ids: list[int], temperature: float, seed: int) -> Turn: ...
    def timing(self) -> tuple[int, float, float]: ...   # (spec steps, draft s, verify s) so far
    def close(self) -> None: ...


def run_unit(gen: Generator, template: Callable[[list[dict]], list[int]], prompts: list[BenchPrompt],
             temperature: float, seed: int) -> dict:
    """Tokens/s, TTFT and speculation counters of `gen` over `prompts` (wall time covers
    generation only, prefill included)."""
    steps0, draft0, verify0 = gen.timing()
    tokens, seconds, ttfts, totals = 0, 0.0, [], {"verify_steps": 0, "emitted": 0, "drafted": 0}
    depth: list[int] = []
    for i, p in enumerate(prompts):
        answers: list[str] = []
        for _ in p.turns:
            ids = template(p.messages(answers))
            start = time.perf_counter()
            turn = gen.generate(ids, temperature, seed + i)
            seconds += time.perf_counter() - start
            tokens += len(turn.token_ids)
            ttfts.append(turn.ttft)
            answers.append(turn.text)
            totals["verify_steps"] += turn.verify_steps
            totals["emitted"] += turn.emitted_tokens
            totals["drafted"] += turn.draft_tokens
            depth = add_depths(depth, list(turn.accepted_per_depth))
    steps, draft, verify = (b - a for a, b in zip((steps0, draft0, verify0), gen.timing()))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else 0.0,
            "ttft_ms": statistics.median(ttfts) * 1e3, "turns": len(ttfts), **totals,
            "accepted_per_depth": depth,
            "draft_ms_per_step": draft / steps * 1e3 if steps else None,
            "verify_ms_per_step": verify / steps * 1e3 if steps else None}


class TercelGenerator:
    """A fresh batch-1 engine for one cell."""

    def __init__(self, cell: Cell, settings: RunSettings):
        self.settings = settings
        self.llm = LLM(settings.model, drafter=cell.drafter, speculation=cell.speculation(), max_num_seqs=1,
                       quantization=cell.quantization, adaptive=AdaptiveConfig(enabled=settings.adaptive),
                       tensor_parallel_size=settings.tensor_parallel_size,
                       lora_modules=(settings.lora,) if settings.lora else ())

    def template(self, messages: list[dict]) -> list[int]:
        return self.llm.apply_chat_template(messages)

    def generate(self, prompt_ids: list[int], temperature: float, seed: int) -> Turn:
        params = SamplingParams(temperature=temperature, max_tokens=self.settings.max_tokens, seed=seed,
                                ignore_eos=self.settings.ignore_eos)
        out = self.llm.generate(prompt_ids, params, lora=self.settings.lora[0] if self.settings.lora else None)[0]
        st = out.stats
        return Turn(list(out.token_ids), out.text, out.ttft, st.verify_steps, st.emitted_tokens,
                    st.draft_tokens, tuple(st.accepted_per_depth))

    def timing(self) -> tuple[int, float, float]:
        t = self.llm.engine.stats().timing
        return t.steps, t.draft_seconds, t.verify_seconds

    def close(self) -> None:
        # The checks read rank 0's bookkeeping only: stop the tensor-parallel workers first, so
        # that the next cell's engine can start its own group even if a check fails.
        self.llm.close()
        self.llm.engine.check_integrity()
        used = self.llm.engine.stats().kv_blocks_used
        if used:
            raise RuntimeError(f"benchmark engine leaked {used} KV blocks")
        del self.llm
        gc.collect()
