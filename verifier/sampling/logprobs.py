"""Logprobs of chosen tokens and their most likely alternatives, as OpenAI and vLLM report them.

Which distribution (`LogprobsMode`, vLLM's `--logprobs-mode`):
    raw        log-softmax of the target's logits as the forward gave them (vLLM's default):
               before penalties, temperature and truncation, after a grammar's mask (a
               constrained request's disallowed tokens are -inf, its allowed ones renormalised)
    processed  the distribution sampled from: logit_bias, min_tokens' mask, penalties,
               temperature, top-k/top-p/min-p (at temperature 0 all but the temperature and
               truncation: greedy decoding has none)
A row the grammar decides (one token allowed) has no logits: that token has logprob 0 and
no alternative. The values depend on the row's logits alone, so a verify row and a decode
step give the same bits where the forward's rows are row-invariant (the CPU engine's are).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from verifier.sampling.sampler import target_probs, transform_logits
from verifier.sampling.sampling_params import SamplingParams

LogprobsMode = Literal["raw", "processed"]


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float                          # -inf where the token was impossible
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token, logprob), most likely first


def row_logprob(row: torch.Tensor, token: int, k: int, mode: LogprobsMode = "raw",
                params: SamplingParams | None = None, prompt: list[int] = (), output: list[int] = (),
                held_back: frozenset[int] = frozenset()) -> TokenLogprob:
    """`token`'s logprob under one row of logits [V] (processed: `output` the tokens before it and
    `held_back` what min_tokens masks, as the logits transform takes them)."""
    lp = _distribution(row, mode, params, prompt, output, held_back)
    top = ()
    if k:
        values, ids = torch.topk(lp, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), top)


def decided(token: int, k: int) -> TokenLogprob:
    """A token the grammar alone allows: probability 1 under the mask."""
    return TokenLogprob(token, 0.0, ((token, 0.0),) if k else ())


def _distribution(row: torch.Tensor, mode: LogprobsMode, params, prompt, output, held_back) -> torch.Tensor:
    x = row.float()[None]
    if mode == "processed":
        x = transform_logits(x[0], params, list(prompt), list(output), held_back)[None]
        if not params.greedy:
            return torch.log(target_probs(x, params))[0]
    return torch.log_softmax(x, dim=-1)[0]
