"""The logits transform at the edges of its ranges: every accepted SamplingParams yields a
distribution (finite, summing to 1, holding the most likely token). The server fuzz test
found top_p=5e-324 and temperature=1e-300 breaking this."""
from __future__ import annotations

import itertools

import pytest
import torch

from verifier.sampling.sampler import sample_token, target_probs, transform_logits
from verifier.sampling.sampling_params import SamplingParams
from verifier.sampling.thinking import ThinkingBudget


def logits(seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 8


@pytest.mark.parametrize("temperature, top_p, top_k, min_p", list(itertools.product(
    [1e-5, 0.7, 2.0], [5e-324, 1e-12, 0.5, 1.0], [0, 1, 50], [0.0, 1.0])))
def test_every_accepted_setting_gives_a_distribution_with_the_argmax_in_it(temperature, top_p, top_k, min_p):
    x = logits()
    p = target_probs(x, SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))
    assert (p.gather(-1, x.argmax(-1, keepdim=True)) > 0).all()


def test_a_top_p_below_fp32_keeps_only_the_top_token():
    x = logits(1)
    p = target_probs(x, SamplingParams(max_tokens=1, top_p=5e-324))
    assert torch.equal(p, torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float())


@pytest.mark.parametrize("temperature", [1e-300, 9.9e-6])
def test_a_temperature_below_1e_5_samples_the_argmax(temperature):
    x = logits(2)[0]
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=0)
    assert params.greedy
    assert sample_token(x, params, [], [], torch.Generator().manual_seed(0)) == int(x.argmax())


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
@pytest.mark.parametrize("penalty", [0.01, 10.0])
def test_the_strongest_penalties_still_give_a_token(temperature, penalty):
    """repetition_penalty=5e-324 made logits / penalty inf: the floor is 0.01."""
    x = logits(3)[0] * 4
    params = SamplingParams(max_tokens=1, temperature=temperature, repetition_penalty=penalty, presence_penalty=2.0,
                            frequency_penalty=-2.0, seed=0)
    token = sample_token(x, params, list(range(0, 512, 2)), [1, 1, 3], torch.Generator().manual_seed(0))
    assert 0 <= token < x.shape[0]


def test_a_repetition_penalty_below_the_floor_is_refused():
    with pytest.raises(ValueError, match="repetition_penalty must be >= 0.01"):
        SamplingParams(max_tokens=1, repetition_penalty=5e-324)


def test_a_thinking_budget_forces_the_blocks_end_once_spent():
    """Two tokens of a block opened by (7, 8), then its end (5, 6) one token at a time; nothing
    where the reply answered without a block, closed it in time, or has its end written."""
    b = ThinkingBudget(2, end_ids=(5, 6), start_ids=(7, 8))
    assert [b.forced(out) for out in ([7, 8], [7, 8, 1], [7, 8, 1, 2], [7, 8, 1, 2, 5], [7, 8, 1, 2, 5, 6])] \
        == [None, None, 5, 6, None]
    assert b.forced([7, 9, 1, 2]) is None and b.forced([1, 2, 3, 4]) is None      # no block opened
    assert b.forced([7, 8, 5, 6]) is None                                         # closed within the budget
    opened = ThinkingBudget(2, end_ids=(5,))                                      # the template opened it
    assert [opened.forced(out) for out in ([1], [1, 2], [1, 2, 5])] == [None, 5, None]
    row = transform_logits(torch.randn(10), SamplingParams(thinking=opened), [3], [1, 2])
    assert row.argmax() == 5 and torch.isinf(row).sum() == 9
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            ThinkingBudget(bad, end_ids=(5,))
    masked = torch.randn(10)
    masked[5] = float("-inf")                                                     # a grammar left it out
    assert torch.equal(transform_logits(masked, SamplingParams(thinking=opened), [3], [1, 2]), masked)
