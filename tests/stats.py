"""Goodness-of-fit helpers for the exactness tests (scipy is not a dependency)."""
from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit. Bins expected below 5 are pooled into one; an
    observation in a bin of probability 0 (an impossible sequence) gives p = 0."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * counts.sum()
    big = exp >= 5
    obs_b, exp_b = counts[big], exp[big]
    pooled_obs, pooled_exp = counts[~big].sum(), exp[~big].sum()
    if pooled_exp >= 5:
        obs_b, exp_b = torch.cat([obs_b, pooled_obs[None]]), torch.cat([exp_b, pooled_exp[None]])
    elif pooled_exp > 0:      # too little to stand alone: fold it into the smallest bin
        i = exp_b.argmin()
        obs_b[i] += pooled_obs
        exp_b[i] += pooled_exp
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    df = obs_b.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())
