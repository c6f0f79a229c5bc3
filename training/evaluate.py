"""Held-out evaluation of a trained drafter with the real engine and tree verifier.

Greedy decoding of held-out prompts (the turns before the first reply, or a benchmark
question's first turn) with speculation; reports the
mean accepted length per verify step (tokens emitted per target forward, the bonus
token included) and the acceptance at each tree depth.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from spec.adaptive import AdaptiveConfig
from spec.llm import LLM
from verifier.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class EvalResult:
    prompts: int
    new_tokens: int
    verify_steps: int
    mean_accepted_length: float
    accepted_per_depth: tuple[float, ...]   # share of verify steps that accepted >= d+1 drafts

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate_drafter(target: str, drafter: str, prompts: list[list[dict]], new_tokens: int,
                     speculation=None, llm=None, quantization: str = "auto") -> EvalResult:
    """`prompts`: chat turns (see `training.data.load_prompts`)."""
    # Whole trees: τ measures the drafter, not what the cost model would verify on this machine.
    llm = llm or LLM(target, drafter=drafter, adaptive=AdaptiveConfig(enabled=False), quantization=quantization,
                     **({"speculation": speculation} if speculation else {}))
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    outs = [llm.chat(p, params)[0] for p in prompts]       # batch 1, as the figures are quoted
    steps = sum(o.stats.verify_steps for o in outs)
    emitted = sum(o.stats.emitted_tokens for o in outs)
    depth = max((len(o.stats.accepted_per_depth) for o in outs), default=0)
    per_depth = tuple(sum(o.stats.accepted_per_depth[d] for o in outs if d < len(o.stats.accepted_per_depth))
                      / max(1, steps) for d in range(depth))
    return EvalResult(len(outs), sum(len(o.token_ids) for o in outs), steps,
                      emitted / max(1, steps), per_depth)
