"""Acceptance statistics of speculative decoding, from the engine's per-request counters.

Over S verify steps (steps whose tree had at least one draft node), with a_d the number of
steps whose accepted path reached depth d (a_0 = S):
- τ, mean accepted length: tokens emitted per verify step, the bonus/corrected token
  included (1 + mean number of accepted draft tokens);
- cumulative acceptance α_d = a_d / S: the share of steps that accepted at least d drafts;
- conditional acceptance α_d|d-1 = a_d / a_{d-1}: of the steps that reached depth d - 1,
  the share that accepted a draft at depth d as well.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFINITIONS = (
    "τ = tokens emitted per verify step (bonus token included); "
    "cumulative α_d = a_d / S, conditional α_d = a_d / a_(d-1), where S is the number of "
    "verify steps and a_d the number of steps that accepted a draft token at depth d (a_0 = S).")


@dataclass(frozen=True)
class Acceptance:
    verify_steps: int
    tau: float | None                      # None: no verify step (plain, or nothing drafted)
    cumulative: tuple[float, ...]          # α_1 ... α_γ
    conditional: tuple[float | None, ...]  # None where the previous depth was never reached


def acceptance(verify_steps: int, emitted_tokens: int, accepted_per_depth: list[int]) -> Acceptance:
    if verify_steps <= 0:
        return Acceptance(0, None, (), ())
    cumulative = tuple(a / verify_steps for a in accepted_per_depth)
    previous = [verify_steps, *accepted_per_depth[:-1]]
    conditional = tuple(a / p if p else None for a, p in zip(accepted_per_depth, previous))
    return Acceptance(verify_steps, emitted_tokens / verify_steps, cumulative, conditional)


def add_depths(total: list[int], more: list[int]) -> list[int]:
    """Elementwise sum of per-depth counters of different lengths."""
    n = max(len(total), len(more))
    return [(total[i] if i < len(total) else 0) + (more[i] if i < len(more) else 0) for i in range(n)]
