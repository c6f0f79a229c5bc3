"""T > 0 exactness of speculative decoding through the whole engine.

A tiny random Llama with a 32-token vocabulary; the exact joint distribution of the first
three generated tokens is computed from HF transformers' logits with the same transform
(temperature, top-k, top-p); 10,000 seeded requests per drafter configuration must match
it by a chi-square test. A deliberately broken acceptance rule must fail the same test.
With quantization="int4" the target is the int4 model, so the law comes from its own
logits: the prompt's last position through the prefill path, the next two tokens as decode
steps, as plain decoding computes them.
"""
from __future__ import annotations

import pytest
import torch

import spec.rejection as rejection
from conftest import make_random_eagle_head, make_tiny_model, slow_marked
from drafters.config import SpecConfig
from exactness_cases import (N_SAMPLES, PARAMS, V, exact_joint, other_draft_dir,  # noqa: F401 (fixtures)
                             prompt, tiny_vocab_dir)
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams
from stats import chi_square_pvalue, total_variation
from verifier.sampling.sampler import target_probs


@pytest.fixture(scope="module")
def eagle_head_dir(tmp_path_factory, tiny_vocab_dir):
    """A random EAGLE-3 head whose draft vocabulary is half the target's: the top-k tree
    proposes tokens the target rarely wants, and some it wants cannot be proposed."""
    return make_random_eagle_head(tiny_vocab_dir, tmp_path_factory.mktemp("v32eagle"), draft_vocab=16, seed=5)


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    """The same vocabulary with head size 16, which the fused int4 decode kernels take."""
    return make_tiny_model(tmp_path_factory.mktemp("v32int4"), None, vocab_size=V, hidden_size=64,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, seed=3)


@pytest.fixture(scope="module")
def int4_joint(int4_dir, prompt) -> torch.Tensor:
    """P(t1, t2, t3) of the int4 target, from its own forwards (one per continuation)."""
    from verifier.batch import ForwardBatch, SeqInput
    from verifier.target import TargetModel
    target = TargetModel(str(int4_dir), quantization="int4")
    target.allocate_kv(4, 4)
    table, n = [0, 1, 2], len(prompt)
    params = SamplingParams(**PARAMS)
    probs = lambda seq: target_probs(target.forward(ForwardBatch([seq])).logits, params)[0]  # noqa: E731
    p1 = probs(SeqInput(prompt, 0, table))
    p2, p3 = torch.empty(V, V), torch.empty(V, V, V)
    for a in range(V):
        p2[a] = probs(SeqInput([a], n, table))                  # writes a's KV at position n
        for b in range(V):
            p3[a, b] = probs(SeqInput([b], n + 1, table))
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def sample_counts(model_dir, prompt, drafter: str | None, spec: SpecConfig | None,
                  quantization: str = "auto", trim=None, engine_trim=None) -> tuple[torch.Tensor, dict]:
    """`trim`: replaces the adaptive controller's choice of nodes to verify, and the requests
    go unseeded (a seeded sampled request keeps its whole tree); `engine_trim`: replaces the
    engine's cut of the proposals (a broken control)."""
    kw = dict(drafter=drafter, speculation=spec) if drafter else {}
    if trim is not None:        # the cut is `trim`'s alone: nothing drafted less for this machine's timings
        kw["adaptive"] = WHOLE_TREES
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500,
              quantization=quantization, **kw)
    if trim is not None:
        llm.engine.adaptive.trim = trim
    if engine_trim is not None:
        llm.engine.drafting._trim = engine_trim
    params = [SamplingParams(seed=None if trim else i, **PARAMS) for i in range(N_SAMPLES)]
    outs = llm.generate([prompt] * N_SAMPLES, params)
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N_SAMPLES, 3)
    stats = dict(steps=sum(o.stats.verify_steps for o in outs), accepted=sum(o.stats.accepted_tokens for o in outs))
    assert llm.engine.blocks.num_used_blocks == 0
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), stats


def law_pvalue(label: str, counts: torch.Tensor, stats: dict, joint: torch.Tensor) -> float:
    """The samples' chi-square p against the exact law `joint`, printed with what the drafter did."""
    p = chi_square_pvalue(counts, joint)
    print(f"{label}: chi-square p = {p:.3g}, TV = {total_variation(counts, joint):.3f}, "
          f"accepted {stats['accepted']} tokens in {stats['steps']} verify steps")
    return p


# (drafter, speculation, minimum accepted draft tokens: proof that the drafter was exercised)
CASES = {
    "plain": (None, None, 0),
    "ngram-chain": ("ngram", SpecConfig(num_speculative_tokens=2), 100),
    "small-chain-sampled": ("small:{dir}", SpecConfig(num_speculative_tokens=2), 2000),
    "other-model-chain-sampled": ("small:{other}", SpecConfig(num_speculative_tokens=2), 300),
    "small-tree-topk": ("tree:small:{dir}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 2000),
    "tree-small+ngram": ("tree:small:{dir}+ngram", SpecConfig(num_speculative_tokens=2, topk=2, budget=6), 2000),
    "eagle3-tree": ("eagle3:{eagle}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 300),
    # Trees from the prompt's repeat and from the other requests' outputs, ranked by frequency.
    "suffix-tree": ("suffix", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 2000),
}


# `make test` runs one case per rule: plain, sampled chains with frequent rejections
# (residual sampling), a sampled top-k tree; over int4, a deterministic chain. The rest of
# the matrix (the suffix drafter's frequency-ranked tree among it: a tree, as the top-k one)
# runs under `make test-slow` (each case costs 10-40 s on these CPUs).
SLOW_CASES = {"ngram-chain", "small-chain-sampled", "eagle3-tree", "tree-small+ngram", "suffix-tree"}


@pytest.mark.parametrize("case", slow_marked(CASES, SLOW_CASES))
def test_first_three_tokens_match_target_distribution(tiny_vocab_dir, other_draft_dir, eagle_head_dir, prompt,
                                                      exact_joint, case):
    """10,000 samples of the first three tokens: chi-square p > 0.001 against the exact law.
    The small drafter is the target checkpoint itself (proposals mostly accepted) or a
    different random model (frequent rejections and residual sampling)."""
    drafter, spec, min_accepted = CASES[case]
    drafter = drafter.format(dir=tiny_vocab_dir, other=other_draft_dir, eagle=eagle_head_dir) if drafter else None
    counts, stats = sample_counts(tiny_vocab_dir, prompt, drafter, spec)
    p = law_pvalue(case, counts, stats, exact_joint)
    assert stats["accepted"] >= min_accepted, "the drafter should be exercised, not always rejected"
    assert p > 1e-3


INT4_CASES = ("plain", "ngram-chain", "small-tree-topk", "eagle3-tree")


@pytest.mark.parametrize("case", slow_marked(INT4_CASES, {"plain", "small-tree-topk", "eagle3-tree"}))
def test_int4_target_samples_its_own_distribution(int4_dir, prompt, int4_joint, tmp_path_factory, case):
    """The same chi-square test with quantization="int4": speculation over the int4 target
    (drafters on the dense checkpoint) samples exactly what plain int4 decoding samples."""
    drafter, spec, _ = CASES[case]
    eagle = make_random_eagle_head(int4_dir, tmp_path_factory.mktemp("int4eagle"), draft_vocab=16, seed=5) \
        if case.startswith("eagle3") else None
    drafter = drafter.format(dir=int4_dir, eagle=eagle) if drafter else None
    counts, stats = sample_counts(int4_dir, prompt, drafter, spec, quantization="int4")
    p = law_pvalue(f"int4 {case}", counts, stats, int4_joint)
    assert stats["accepted"] > 0 or drafter is None
    assert p > 1e-3


@pytest.mark.parametrize("case", slow_marked(["other-model-chain-sampled", "suffix-tree"], {"suffix-tree"}))
def test_broken_acceptance_rule_fails_the_same_test(tiny_vocab_dir, other_draft_dir, prompt, exact_joint,
                                                    monkeypatch, case):
    """Skipping the residual update after a rejection (sampling from p instead of
    normalize(max(0, p - q)), or p with the rejected point mass left in) biases the output,
    and the same chi-square test catches it, for sampled chains and for suffix trees."""
    monkeypatch.setattr(rejection, "_residual", lambda p, q, tried: p)
    drafter, spec, _ = CASES[case]
    counts, _ = sample_counts(tiny_vocab_dir, prompt, drafter.format(other=other_draft_dir), spec)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"broken rule, {case}: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}")
    assert p < 1e-3


def random_cuts(cands, decoding, base_rows, prompt_rows=0, rng=__import__("random").Random(0)):
    """A cut per proposal that has nothing to do with the target's logits, as the adaptive
    controller's (which follows timings and past acceptance)."""
    return [rng.randint(0, len(c.depths)) for c in cands]


# Under `make test-slow`: the batch guard's test below cuts every proposal at random too.
@pytest.mark.slow
def test_proposals_cut_by_the_adaptive_controller_keep_the_distribution(tiny_vocab_dir, other_draft_dir, prompt,
                                                                        exact_joint):
    """Sampled chains from a different model (frequent rejections), each cut to a length of
    the controller's choosing before verification: the law is still the target's."""
    counts, stats = sample_counts(tiny_vocab_dir, prompt, f"small:{other_draft_dir}",
                                  SpecConfig(num_speculative_tokens=2), trim=random_cuts)
    p = law_pvalue("cut proposals", counts, stats, exact_joint)
    assert stats["accepted"] >= 300 and p > 1e-3


def test_steps_the_batch_guard_keeps_plain_keep_the_distribution(tiny_vocab_dir, other_draft_dir, prompt,
                                                                 exact_joint, monkeypatch):
    """The batch guard decides per step, before drafting, whether the batch drafts at all (from
    past steps' timings): here a coin per step stands in for it, with the controller's cuts
    random as above. The law is still the target's."""
    import random

    import spec.batch_guard as bg
    rng = random.Random(1)
    monkeypatch.setattr(bg.BatchGuard, "speculates", lambda self, decoding: rng.random() < 0.5)
    counts, stats = sample_counts(tiny_vocab_dir, prompt, f"small:{other_draft_dir}",
                                  SpecConfig(num_speculative_tokens=2), trim=random_cuts)
    p = law_pvalue("guarded steps", counts, stats, exact_joint)
    assert stats["accepted"] >= 100 and p > 1e-3


def test_a_cut_that_reads_the_sampled_tokens_fails_the_same_test(tiny_vocab_dir, other_draft_dir, prompt,
                                                                  exact_joint):
    """The control: a cut that looks at what a sampling drafter drew (keeping a chain only
    where its first token is even, as trusting a drafter's confidence in its own draw would)
    biases the output, and the same test catches it. This is why the controller reads the
    scores of deterministic proposals only (spec/drafting.py, `candidate`)."""
    def by_token(drafted, props, plans):
        return [p if p.tree.tokens[1] % 2 == 0 else None for p in props]
    counts, _ = sample_counts(tiny_vocab_dir, prompt, f"small:{other_draft_dir}",
                              SpecConfig(num_speculative_tokens=2), trim=random_cuts, engine_trim=by_token)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"token-read cut: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}")
    assert p < 1e-3
