"""T > 0 exactness of constrained decoding under speculation and jump-forward.

A tiny random Llama with a 32-token vocabulary spelled as single characters (a tokenizer
written here), and the grammar (a regex) `(a[b-e]|bz|[c-f][g-m])[n-z]+`: three branches,
a forced token after "b" (jump-forward), and at every step a mask that leaves out most of
the vocabulary, so drafters propose tokens the grammar forbids. The exact law of the first
three tokens is the target's masked, renormalised distribution, computed here from HF
transformers' logits and the grammar written out by hand; 6,000 seeded requests per
configuration must match it (chi-square). Masking p but not a sampling drafter's q must
fail the same test.

Tool calls are such a constraint too (serving/tools/constraint.py): a format spelled in this
vocabulary (a call is "xq" name "y" arguments "z": "q" is forced after the trigger), tools named "ab", "ac" and "b", and
`tool_choice: auto` beside a text regex: the reply is that text or calls from its first
token. Its exact law reads the allowed tokens off the grammar itself (xgrammar's matcher).
"""
from __future__ import annotations

import json

import pytest
import torch

import spec.constraints as constraints
from conftest import make_random_eagle_head, make_tiny_model, slow_marked
from drafters.config import SpecConfig
from serving.tools.constraint import ToolChoice, tool_constraint
from serving.tools.formats import ToolFormat
from spec import LLM, SamplingParams, StructuredOutputs
from stats import chi_square_pvalue, total_variation
from verifier.sampling.grammar import allowed_tokens
from verifier.sampling.sampler import target_probs

V = 32
CHARS = "abcdefghijklmnopqrstuvwxyz012"          # token 3 + i; 0-2 are <unk>, <s>, </s>
REGEX = "(a[b-e]|bz|[c-f][g-m])[n-z]+"
N_SAMPLES = 6_000
PARAMS = dict(temperature=0.9, top_k=12, top_p=0.9, max_tokens=3, ignore_eos=True)


def ids(text: str) -> list[int]:
    return [3 + CHARS.index(c) for c in text]


def span(lo: str, hi: str) -> list[int]:
    return ids(CHARS[CHARS.index(lo):CHARS.index(hi) + 1])


# The regex by hand: the tokens allowed first, second (given the first) and third.
FIRST = span("a", "f")
SECOND = {**{t: span("g", "m") for t in span("c", "f")}, ids("a")[0]: span("b", "e"), ids("b")[0]: ids("z")}
THIRD = span("n", "z")


def write_char_tokenizer(model_dir) -> None:
    from tokenizers import Tokenizer, models
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def tiny(tmp_path_factory, name: str, seed: int):
    d = make_tiny_model(tmp_path_factory.mktemp(name), None, vocab_size=V, hidden_size=32, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=2, seed=seed)
    write_char_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny(tmp_path_factory, "g32", 3)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another random model on the same vocabulary: its q spreads over forbidden tokens."""
    return tiny(tmp_path_factory, "g32draft", 4)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target_dir):
    return make_random_eagle_head(target_dir, tmp_path_factory.mktemp("g32eagle"), draft_vocab=16, seed=5)


# The n-gram drafter proposes from this context what followed the same letter: after "a",
# "d" or "f" a token the grammar allows next, after "e" one it forbids ("x").
PROMPT = ids("abdhexfkcg")


def masked_probs(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    x = torch.full_like(logits, float("-inf"))
    x[..., allowed] = logits[..., allowed]
    return target_probs(x, SamplingParams(**PARAMS))


@pytest.fixture(scope="module")
def exact_joint(target_dir) -> torch.Tensor:
    """P(t1, t2, t3) flattened to V**3: the masked law, from HF logits of every continuation."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    joint = torch.zeros(V, V, V)
    with torch.no_grad():
        p1 = masked_probs(hf(torch.tensor([PROMPT])).logits[0, -1], FIRST)
        for t1, second in SECOND.items():
            p2 = masked_probs(hf(torch.tensor([PROMPT + [t1]])).logits[0, -1], second)
            rows = torch.tensor([PROMPT + [t1, t2] for t2 in second])
            p3 = masked_probs(hf(rows).logits[:, -1], THIRD)                   # [len(second), V]
            joint[t1, second] = p1[t1] * p2[second][:, None] * p3
    return joint.reshape(-1)


CHAR_CALLS = ToolFormat(name="chars", trigger="x", begin="xq", between="y", end="z", separator="", tool_role="user",
                        instructions="", in_system=False)
CHAR_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "integer"}}}
              for name in ("ab", "ac", "b")]
TOOL_CALLS = tool_constraint(CHAR_CALLS, CHAR_TOOLS, ToolChoice("auto"), StructuredOutputs(regex="[d-w][d-w][d-w]+"))


@pytest.fixture(scope="module")
def tool_joint(target_dir) -> torch.Tensor:
    """P(t1, t2, t3) under TOOL_CALLS: the target's law masked by what the grammar allows."""
    from transformers import AutoModelForCausalLM
    llm = LLM(str(target_dir), max_model_len=64, num_kv_blocks=64, block_size=4)
    backend = llm.engine.grammars

    def allowed(prefix: list[int]) -> list[int]:
        matcher = backend.matcher(TOOL_CALLS)
        assert all(matcher.accept(t) for t in prefix)
        return allowed_tokens(matcher.mask(), V)[0].nonzero()[:, 0].tolist()

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    joint = torch.zeros(V, V, V)
    with torch.no_grad():
        step = lambda prefix: masked_probs(hf(torch.tensor([PROMPT + prefix])).logits[0, -1], allowed(prefix))
        p1 = step([])
        for t1 in allowed([]):
            p2 = step([t1])
            for t2 in allowed([t1]):
                joint[t1, t2] = p1[t1] * p2[t2] * step([t1, t2])
    calls = joint[ids("x")[0]].sum()
    print(f"P(a call) = {calls:.3f}")
    assert 0.01 < calls < 0.99, "both branches should be taken"
    return joint.reshape(-1)


def sample_counts(model_dir, drafter: str | None, spec: SpecConfig | None,
                  structured: StructuredOutputs = StructuredOutputs(regex=REGEX)) -> tuple[torch.Tensor, dict]:
    kw = dict(drafter=drafter, speculation=spec) if drafter else {}
    llm = LLM(str(model_dir), max_model_len=64, num_kv_blocks=2048, block_size=4, max_num_seqs=500, **kw)
    params = [SamplingParams(seed=i, structured=structured, **PARAMS) for i in range(N_SAMPLES)]
    outs = llm.generate([PROMPT] * N_SAMPLES, params)
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N_SAMPLES, 3)
    stats = dict(accepted=sum(o.stats.accepted_tokens for o in outs), forced=sum(o.stats.forced_tokens for o in outs))
    assert llm.engine.blocks.num_used_blocks == 0
    return torch.bincount(toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], minlength=V ** 3), stats


# (drafter, speculation, minimum accepted draft tokens)
CASES = {
    "plain+jump-forward": (None, None, 0),
    "ngram-chain": ("ngram", SpecConfig(num_speculative_tokens=2), 100),
    "other-model-chain-sampled": ("small:{other}", SpecConfig(num_speculative_tokens=2), 300),
    "small-tree-topk": ("tree:small:{target}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 500),
    "eagle3-tree": ("eagle3:{eagle}", SpecConfig(num_speculative_tokens=2, topk=3, budget=6), 100),
}


# `make test` runs plain + jump-forward and a sampled chain with frequent rejections (masked q),
# beside the broken controls; the trees and the n-gram chain run under `make test-slow`
# (20-40 s each on a 2-vCPU machine). T=0 identity covers every drafter's tree in `make test`.
SLOW_CASES = {"ngram-chain", "small-tree-topk", "eagle3-tree"}


@pytest.mark.parametrize("case", slow_marked(CASES, SLOW_CASES))
def test_constrained_samples_follow_the_masked_target_law(target_dir, other_dir, eagle_dir, exact_joint, case):
    drafter, spec, min_accepted = CASES[case]
    drafter = drafter.format(target=target_dir, other=other_dir, eagle=eagle_dir) if drafter else None
    counts, stats = sample_counts(target_dir, drafter, spec)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"{case}: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}, "
          f"accepted {stats['accepted']} drafted, {stats['forced']} forced")
    assert stats["accepted"] >= min_accepted, "the drafter should be exercised"
    assert stats["forced"] > 1000, "jump-forward should take the forced 'z' after 'b'"
    assert p > 1e-3


@pytest.mark.parametrize("broken", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["exact", "unmasked-q"])
def test_tool_calls_follow_the_masked_target_law(target_dir, other_dir, tool_joint, monkeypatch, broken):
    """A sampled draft chain from another model under the tool-call constraint; with q left
    unmasked (the broken rule) the same test must fail."""
    if broken:
        monkeypatch.setattr(constraints, "masked_q", lambda probs, masks: probs)
    counts, stats = sample_counts(target_dir, f"small:{other_dir}", SpecConfig(num_speculative_tokens=2), TOOL_CALLS)
    p = chi_square_pvalue(counts, tool_joint)
    print(f"tool calls{' (q unmasked)' if broken else ''}: chi-square p = {p:.3g}, "
          f"TV = {total_variation(counts, tool_joint):.3f}, accepted {stats['accepted']}, forced {stats['forced']}")
    assert stats["accepted"] >= 300 and stats["forced"] > 100
    assert (p < 1e-3) if broken else (p > 1e-3)


def test_masking_p_but_not_q_fails_the_same_test(target_dir, other_dir, exact_joint, monkeypatch):
    """Pruned children were drawn from q restricted to the grammar; accepting them against
    the unmasked q biases the output, and the chi-square test catches it."""
    monkeypatch.setattr(constraints, "masked_q", lambda probs, masks: probs)
    counts, _ = sample_counts(target_dir, f"small:{other_dir}", SpecConfig(num_speculative_tokens=2))
    p = chi_square_pvalue(counts, exact_joint)
    print(f"unmasked q: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}")
    assert p < 1e-3


def test_rows_the_grammar_decides_get_no_logits(target_dir, monkeypatch):
    """Under `bz[n-z]+` the grammar decides the first two tokens: plain constrained decoding
    (no jump-forward, no drafter) asks the target for no logits of those two rows, and still
    emits them."""
    from verifier.target import TargetModel
    asked = []
    forward = TargetModel.forward

    def spy(self, batch):
        asked.append([s.sample_indices for s in batch.seqs])
        return forward(self, batch)

    llm = LLM(str(target_dir), max_model_len=64, num_kv_blocks=64, block_size=4, jump_forward=False)
    monkeypatch.setattr(TargetModel, "forward", spy)
    out = llm.generate([PROMPT], [SamplingParams(structured=StructuredOutputs(regex="bz[n-z]+"), temperature=0,
                                                 max_tokens=3, ignore_eos=True)])[0]
    assert out.token_ids[:2] == ids("bz") and out.token_ids[2] in THIRD
    assert asked == [[[]], [[]], [[0]]]     # the prompt (then "b"), "b" (then "z"), "z" (then [n-z])


def test_a_row_taken_as_decided_when_it_is_not_fails_the_same_test(target_dir, exact_joint, monkeypatch):
    """Broken control for the rows without logits: taking a row that allows several tokens
    as decided (its first allowed token, with probability 1) must fail the chi-square test."""
    import spec.constraints as constraints

    def first_allowed(masks):
        return [int(row.nonzero()[0]) for row in allowed_tokens(masks, V)]

    monkeypatch.setattr(constraints, "sole_tokens", first_allowed)
    counts, _ = sample_counts(target_dir, None, None)
    p = chi_square_pvalue(counts, exact_joint)
    print(f"rows taken as decided: chi-square p = {p:.3g}, TV = {total_variation(counts, exact_joint):.3f}")
    assert p < 1e-3


def test_sole_tokens_finds_rows_that_allow_exactly_one_token():
    from verifier.sampling.grammar import sole_tokens
    masks = torch.zeros(5, 4, dtype=torch.int32)
    masks[0, 1] = 1 << 5                       # token 37 alone
    masks[1, 0] = 0b11                         # two tokens
    masks[2, 3] = -(1 << 31)                   # bit 31 of word 3: token 127 alone
    masks[3, 0] = masks[3, 2] = 1              # two words
    assert sole_tokens(masks) == [37, -1, 127, -1, -1]


def test_the_c_bitmask_masks_what_the_torch_one_masks(monkeypatch):
    """verifier.sampling.grammar.apply_bitmask's C path against its torch path, a vocabulary that is not
    a multiple of 32 included."""
    from verifier.cpu import cpu_ops
    from verifier.sampling import grammar
    g = torch.Generator().manual_seed(2)
    for v in (49152, 1000):
        masks = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (v + 31) // 32), dtype=torch.int32, generator=g)
        masks[0] = -1                                   # all allowed
        masks[1, :5] = 0                                # none of the first 160
        logits = torch.randn(3, v, generator=g)
        fast = logits.clone()
        grammar.apply_bitmask(fast, masks)
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
        slow = logits.clone()
        grammar.apply_bitmask(slow, masks)
        monkeypatch.undo()
        assert torch.equal(fast, slow)
