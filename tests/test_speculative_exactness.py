"""T > 0 exactness of speculative decoding through the whole engine.

A tiny random Llama with a 32-token vocabulary; the exact joint distribution of the first
three generated tokens is computed from HF transformers' logits with the same transform
(temperature, top-k, top-p); 10,000 seeded requests per drafter configuration must match
it by a chi-square test. A deliberately broken acceptance rule must fail the same test.
"""
from __future__ import annotations

import pytest
import torch

import spec.rejection as rejection
from conftest import make_random_eagle_head, make_tiny_model
from spec import LLM, SamplingParams
from spec.config import SpecConfig
from spec.sampler import target_probs
from stats import chi_square_pvalue, total_variation

V = 32
N_SAMPLES = 10_000
PARAMS = dict(temperature=0.9, top_k=12, top_p=0.9, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory):
    # Larger weights than the defaults give peaked, model-like distributions.
    return make_tiny_model(tmp_path_factory.mktemp("v32"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=3)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random model with the same vocabulary: q differs from p, so rejections
    and residual sampling happen often."""
    return make_tiny_model(tmp_path_factory.mktemp("v32draft"), None, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=4)


@pytest.fixture(scope="module")
def eagle_head_dir(tmp_path_factory, tiny_vocab_dir):
    """A random EAGLE-3 head whose draft vocabulary is half the target's: the top-k tree
    proposes tokens the target rarely wants, and some it wants cannot be proposed."""
    return make_random_eagle_head(tiny_vocab_dir, tmp_path_factory.mktemp("v32eagle"), draft_vocab=16, seed=5)


@pytest.fixture(scope="module")
def prompt(tiny_vocab_dir) -> list[int]:
    """A prompt [y, x, t, z, y, x] whose likeliest next token is t: the n-gram drafter then
    proposes (t, z) after the repeated (y, x), and the model often accepts it."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_vocab_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    y, x, t, z = torch.randint(0, V, (4, 4096), generator=g)
    cand = torch.stack([y, x, t, z, y, x], 1)
    with torch.no_grad():
        probs = torch.softmax(hf(cand).logits[:, -1], -1)
    p_t = probs.gather(1, t[:, None])[:, 0]
    best = int(torch.where(probs.argmax(-1) == t, p_t, torch.zeros_like(p_t)).argmax())
    assert probs[best].argmax() == t[best]
    return cand[best].tolist()


@pytest.fixture(scope="module")
def exact_joint(tiny_vocab_dir, prompt) -> torch.Tensor:
    """P(t1, t2, t3) flattened to V**3, from HF logits of every 2-token continuation."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_vocab_dir), dtype=torch.float32).eval()
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    with torch.no_grad():
        logits = hf(ids).logits
    params = SamplingParams(**PARAMS)
    p1 = target_probs(logits[0, -3][None], params)[0]                       # [V]
    p2 = target_probs(logits[::V, -2], params)                              # [V(t1), V]
    p3 = target_probs(logits[:, -1], params).view(V, V, V)                  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def sample_counts(model_dir, prompt, drafter: str | None, spec: SpecConfig | None) -> tuple[torch.Tensor, dict]:
    kw = dict(drafter=drafter, speculation=spec) if drafter else {}
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500, **kw)
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params)
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N_SAMPLES, 3)
    stats = dict(steps=sum(o.stats.verify_steps for o in outs), accepted=sum(o.stats.accepted_tokens for o in outs))
    assert llm.engine.blocks.num_used_blocks == 0
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), stats


# (drafter, speculation, minimum accepted draft tokens: proof that the drafter was exercised)
CASES = {
    "plain": (None, None, 0),
    "ngram-chain": ("ngram", SpecConfig(num_speculative_tokens=2), 100),
    "small-chain-sampled": ("small:{dir}", SpecConfig(num_speculative_tokens=2), 2000),
    "other-model-chain-sampled": ("small:{other}", SpecConfig(num_speculative_tokens=2), 300),
    "small-tree-topk": ("tree:small:{dir}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 2000),
    "tree-small+ngram": ("tree:small:{dir}+ngram", SpecConfig(num_speculative_tokens=2, topk=2, budget=6), 2000),
    "eagle3-tree": ("eagle3:{eagle}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 300),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_three_tokens_match_target_distribution(tiny_vocab_dir, other_draft_dir, eagle_head_dir, prompt,
                                                      exact_joint, case):
    """10,000 samples of the first three tokens: chi-square p > 0.001 against the exact law.
    The small drafter is the target checkpoint itself (proposals mostly accepted) or a
    different random model (frequent rejections and residual sampling)."""
    drafter, spec, min_accepted = CASES[case]
    drafter = drafter.format(dir=tiny_vocab_dir, other=other_draft_dir, eagle=eagle_head_dir) if drafter else None
    counts, stats = sample_counts(tiny_vocab_dir, prompt, drafter, spec)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"{case}: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}, "
          f"accepted {stats['accepted']} tokens in {stats['steps']} verify steps")
    assert stats["accepted"] >= min_accepted, "the drafter should be exercised, not always rejected"
    assert p > 1e-3


def test_broken_acceptance_rule_fails_the_same_test(tiny_vocab_dir, other_draft_dir, prompt, exact_joint,
                                                    monkeypatch):
    """Skipping the residual update after a rejection (sampling from p instead of
    normalize(max(0, p - q))) biases the output, and the same chi-square test catches it."""
    monkeypatch.setattr(rejection, "_residual", lambda p, q, tried: p)
    counts, _ = sample_counts(tiny_vocab_dir, prompt, f"small:{other_draft_dir}",
                              SpecConfig(num_speculative_tokens=2))
    p = chi_square_pvalue(counts, exact_joint)
    print(f"broken rule: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}")
    assert p < 1e-3
