"""T > 0 exactness of predicted outputs through the whole engine, on the chi-square test of
tests/engine/test_speculative_exactness.py: 10,000 seeded requests on the 32-token random model, the
joint law of their first three tokens against the exact one. Each request predicts the law's
likeliest three tokens, so its chain is often accepted in part and rejected after, and resyncs
when the first token leaves it. A lossy rule that a real implementation could adopt (trusting a
predicted token the target finds plausible, as Medusa's typical acceptance does) must fail."""
from __future__ import annotations

import pytest
import torch

import spec.rejection as rejection
from conftest import slow_marked
from drafters.config import SpecConfig
from exactness_cases import (N_SAMPLES, PARAMS, V, exact_joint, other_draft_dir,  # noqa: F401 (fixtures)
                             prompt, tiny_vocab_dir)
from spec import LLM, Prediction, SamplingParams
from stats import chi_square_pvalue, total_variation

# Four tokens, so that the first decode step verifies a chain of two (γ = 2) below the first;
# the law tested is the first three tokens'.
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def likeliest(exact_joint) -> Prediction:  # noqa: F811
    """The law's mode token by token: what a client would predict."""
    joint = exact_joint.view(V, V, V)
    a = int(joint.sum((1, 2)).argmax())
    b = int(joint[a].sum(1).argmax())
    c = int(joint[a, b].argmax())
    return Prediction((a, b, c, a))


def sample_counts(model_dir, prompt, prediction: Prediction, drafter: str | None,  # noqa: F811
                  spec: SpecConfig) -> tuple[torch.Tensor, dict]:
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500,
              speculation=spec, **({"drafter": drafter} if drafter else {}))
    params = [SamplingParams(seed=i, **{**PARAMS, "max_tokens": MAX_TOKENS}) for i in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params, predictions=prediction)
    toks = torch.tensor([o.token_ids[:3] for o in outs])
    assert toks.shape == (N_SAMPLES, 3)
    stats = dict(accepted=sum(o.stats.prediction_accepted for o in outs),
                 rejected=sum(o.stats.prediction_rejected for o in outs))
    assert llm.engine.blocks.num_used_blocks == 0
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), stats


CHAIN = SpecConfig(num_speculative_tokens=2)
CASES = {
    "prediction": (None, CHAIN),                         # no drafter: the chain is the tree
    "prediction+ngram": ("ngram", CHAIN),                # point masses merged into one tree
    "prediction+small-sampled": ("small:{dir}", CHAIN),  # the chain replaces the sampled chain where it has one
}


@pytest.mark.parametrize("case", slow_marked(CASES, {"prediction+ngram", "prediction+small-sampled"}))
def test_predicted_requests_sample_the_target_distribution(tiny_vocab_dir, prompt, exact_joint,  # noqa: F811
                                                           likeliest, case):
    drafter, spec = CASES[case]
    drafter = drafter.format(dir=tiny_vocab_dir) if drafter else None
    counts, stats = sample_counts(tiny_vocab_dir, prompt, likeliest, drafter, spec)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"{case}: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}, "
          f"prediction tokens accepted {stats['accepted']}, rejected {stats['rejected']}")
    assert stats["accepted"] >= 500 and stats["rejected"] >= 1000, "the prediction should be accepted and rejected"
    assert p > 1e-3


def trusting(real):
    """Typical acceptance for point masses: a predicted token the target gives p >= 0.1 is
    taken without the draw (lossy: it is kept more often than p says)."""
    def try_children(p, q_u, candidates, without_replacement, uniforms):
        if q_u is None:
            for c, x in candidates:
                if float(p[x]) >= 0.1:
                    return c, p
        return real(p, q_u, candidates, without_replacement, uniforms)
    return try_children


def test_trusting_plausible_predicted_tokens_fails_the_same_test(tiny_vocab_dir, prompt, exact_joint,  # noqa: F811
                                                                likeliest, monkeypatch):
    monkeypatch.setattr(rejection, "_try_children", trusting(rejection._try_children))
    counts, stats = sample_counts(tiny_vocab_dir, prompt, likeliest, None, CHAIN)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"trusting plausible predicted tokens: chi-square p = {p:.3g}, "
          f"TV = {total_variation(counts, exact_joint):.3f}, accepted {stats['accepted']}")
    assert p < 1e-3
