"""T > 0 exactness of logit_bias, min_tokens and a thinking budget through the whole engine, as
test_speculative_exactness.py: 10,000 seeded requests of three tokens on the 32-token tiny
model, drafted by a sampling drafter, against the exact law computed from HF logits with the
same transform (`transform_logits`); a broken rule must fail the same test.

The broken controls: the bias left out of the target's p at tree nodes (plain sampling of the
first token keeps it); min_tokens, and the thinking budget, ruling every node by the root's
output length instead of its own depth. (Leaving the bias out of the drafter's q alone is no
control: acceptance is exact for any q that is what the drafter sampled from, so it only costs
acceptance.)
"""
from __future__ import annotations

import pytest
import torch

import spec.acceptance as acceptance_module
from conftest import slow_marked
from drafters.config import SpecConfig
from exactness_cases import (EOS, N_SAMPLES, V, exact_joint_for, other_draft_dir,  # noqa: F401 (fixtures)
                             prompt, tiny_vocab_dir)
from spec import LLM, SamplingParams
from stats import chi_square_pvalue, total_variation
from tree.token_tree import TokenTree
from verifier.sampling.sampler import transform_logits
from verifier.sampling.thinking import ThinkingBudget

BASE = dict(temperature=0.9, top_k=12, top_p=0.9, max_tokens=3)
CHAIN = SpecConfig(num_speculative_tokens=2)


@pytest.fixture(scope="module")
def biased(prompt) -> SamplingParams:
    """The prompt's likeliest next token banned, two others pushed up: a law far from the unbiased one."""
    t = prompt[2]                 # the prompt's design: t is the likeliest token after it
    return SamplingParams(ignore_eos=True, logit_bias={t: -100, (t + 5) % V: 2.0, (t + 11) % V: 1.5}, **BASE)


@pytest.fixture(scope="module")
def held() -> SamplingParams:
    """EOS made likely (bias +3), and held back for the first two tokens: the third may be EOS."""
    return SamplingParams(min_tokens=2, logit_bias={EOS: 3.0}, **BASE)


def sample_counts(model_dir, prompt, drafter: str, params: SamplingParams) -> tuple[torch.Tensor, int]:
    """Counts of the first three tokens over N_SAMPLES seeded requests, and the accepted drafts."""
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500,
              drafter=drafter, speculation=CHAIN)
    outs = llm.generate([prompt] * N_SAMPLES, [SamplingParams(**{**_fields(params), "seed": i})
                                               for i in range(N_SAMPLES)])
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N_SAMPLES, 3) and llm.engine.blocks.num_used_blocks == 0
    accepted = sum(o.stats.accepted_tokens for o in outs)
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), accepted


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields
    return {f.name: getattr(params, f.name) for f in fields(params)}


def fit(tiny_vocab_dir, prompt, drafter: str, params: SamplingParams, label: str) -> tuple[float, int]:
    law = exact_joint_for(tiny_vocab_dir, prompt, params)
    counts, accepted = sample_counts(tiny_vocab_dir, prompt, drafter, params)
    p = chi_square_pvalue(counts, law)
    print(f"{label}: chi-square p = {p:.3g}, TV = {total_variation(counts, law):.3f}, accepted {accepted}")
    return p, accepted


# The target drafting for itself (q follows p, most drafts accepted) in `make test`; a
# different model (frequent rejections, residual sampling) under `make test-slow`.
DRAFTERS = {"self": "small:{dir}", "other": "small:{other}"}


@pytest.mark.parametrize("drafter", slow_marked(DRAFTERS, {"other"}))
def test_logit_bias_keeps_the_targets_law(tiny_vocab_dir, other_draft_dir, prompt, biased, drafter):
    p, accepted = fit(tiny_vocab_dir, prompt, DRAFTERS[drafter].format(dir=tiny_vocab_dir, other=other_draft_dir),
                      biased, f"logit_bias, {drafter}")
    assert accepted >= 300 and p > 1e-3


@pytest.mark.parametrize("drafter", slow_marked(DRAFTERS, {"other"}))
def test_min_tokens_keeps_the_targets_law(tiny_vocab_dir, other_draft_dir, prompt, held, drafter):
    p, accepted = fit(tiny_vocab_dir, prompt, DRAFTERS[drafter].format(dir=tiny_vocab_dir, other=other_draft_dir),
                      held, f"min_tokens, {drafter}")
    assert accepted >= 300 and p > 1e-3


@pytest.mark.slow
def test_a_bias_missing_from_the_tree_nodes_p_fails_the_same_test(tiny_vocab_dir, prompt, biased, monkeypatch):
    """The control: acceptance reads p without the bias (plain sampling keeps it), so accepted
    drafts and residuals follow the unbiased law."""
    def unbiased(logits, params, *args):
        return transform_logits(logits, SamplingParams(**{**_fields(params), "logit_bias": ()}), *args)
    monkeypatch.setattr(acceptance_module, "transform_logits", unbiased)
    p, _ = fit(tiny_vocab_dir, prompt, f"small:{tiny_vocab_dir}", biased, "broken: bias missing from p")
    assert p < 1e-3


def test_min_tokens_at_the_roots_depth_fails_the_same_test(tiny_vocab_dir, prompt, held, monkeypatch):
    """The control: every node's row masked by the root's output length (as if the path below
    the root were not output yet), so EOS is never accepted as a drafted third token."""
    monkeypatch.setattr(TokenTree, "path_tokens", lambda tree, node: [tree.tokens[0]])
    p, _ = fit(tiny_vocab_dir, prompt, f"small:{tiny_vocab_dir}", held, "broken: min_tokens at the root's depth")
    assert p < 1e-3


@pytest.fixture(scope="module")
def budgeted(prompt) -> SamplingParams:
    """A block the reply opens with the prompt's likeliest next token s (as often as not), one
    token of budget, then its one-token end e forced; e pushed up, so that the block often closes
    within its budget and the third token is free again."""
    s = prompt[2]
    e = (s + 5) % V
    return SamplingParams(ignore_eos=True, logit_bias={e: 2.0},
                          thinking=ThinkingBudget(1, end_ids=(e,), start_ids=(s,)), **BASE)


def test_a_thinking_budget_keeps_the_targets_law(tiny_vocab_dir, prompt, budgeted):
    p, accepted = fit(tiny_vocab_dir, prompt, f"small:{tiny_vocab_dir}", budgeted, "thinking budget, self")
    assert accepted >= 300 and p > 1e-3


@pytest.mark.slow
def test_a_thinking_budget_at_the_roots_depth_fails_the_same_test(tiny_vocab_dir, prompt, budgeted, monkeypatch):
    """The control: every node's row sees the root's output only, so a drafted third token is never
    forced to the block's end."""
    monkeypatch.setattr(TokenTree, "path_tokens", lambda tree, node: [tree.tokens[0]])
    p, _ = fit(tiny_vocab_dir, prompt, f"small:{tiny_vocab_dir}", budgeted, "broken: budget at the root's depth")
    assert p < 1e-3
