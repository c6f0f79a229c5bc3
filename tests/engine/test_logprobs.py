"""Logprobs in the engine, on SmolLM2: the same values, to the bit, with speculation on and off
(every drafter, alone and batched: verify rows and decode steps are row-invariant), tokens
unchanged by asking for them, and prompt logprobs equal to a teacher-forced pass."""
from __future__ import annotations

import math

import pytest

from conftest import IDENTITY_ALONE as ALONE, slow_marked, spec_drafters, write_reply_corpus
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams, StructuredOutputs
from verifier.batch import ForwardBatch, SeqInput
from verifier.sampling.logprobs import row_logprob

DRAFTERS = spec_drafters()
QUESTIONS = ["Name three fruits and say why each is good.", "Explain what a prime number is.",
             "Write a haiku about rain.", "What is the capital of France? Answer in a sentence."]
K = 3


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "logprobs": K, **kw})


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return [plain.generate(p, params())[0] for p in prompts]


def test_asking_for_logprobs_leaves_the_tokens_alone(plain, prompts, reference):
    without = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    assert [o.token_ids for o in without] == [o.token_ids for o in reference]
    assert all(o.logprobs is None for o in without)
    for out in reference:
        assert len(out.logprobs) == len(out.token_ids)
        for token, lp in zip(out.token_ids, out.logprobs):
            assert lp.token == token and len(lp.top) == K and lp.top[0][1] >= lp.logprob
            assert lp.top[0][0] == token         # greedy: the chosen token is the most likely
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plain, reference):
    return write_reply_corpus(tmp_path_factory.mktemp("corpus") / "replies.jsonl", plain,
                              [o.token_ids for o in reference])


@pytest.mark.parametrize("name", slow_marked(DRAFTERS, set(DRAFTERS) - {"tree", "datastore"}))
def test_every_drafter_gives_the_same_logprobs(name, prompts, reference, corpus):
    drafter, spec = DRAFTERS[name]
    # whole trees: the trees are verified (asserted below) whatever a verify row costs here
    llm = LLM(max_num_seqs=8, drafter=drafter.format(corpus=corpus), speculation=spec, adaptive=WHOLE_TREES)
    alone = [llm.generate(p, params())[0] for p in prompts[:ALONE]]
    batch = llm.generate(prompts, params())
    assert [o.logprobs for o in alone] == [o.logprobs for o in reference[:ALONE]]
    assert [o.logprobs for o in batch] == [o.logprobs for o in reference]
    assert sum(o.stats.draft_tokens for o in batch) > 0, "trees should be verified"
    assert llm.engine.blocks.num_used_blocks == 0


def test_sampled_logprobs_match_the_distribution_they_report(plain, prompts):
    """T > 0: the reported logprob of the chosen token is its entry in the top list when it is
    there, and the processed mode's top alternatives sum to at most 1."""
    llm = LLM(max_num_seqs=8, logprobs_mode="processed")
    out = llm.generate(prompts[0], params(temperature=0.8, top_k=5, seed=1))[0]
    for lp in out.logprobs:
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-5
        assert lp.logprob > -math.inf                        # sampled: inside the top-k
        assert dict(lp.top).get(lp.token, lp.logprob) == lp.logprob


def test_rows_the_grammar_decides_have_logprob_zero(plain, prompts):
    out = plain.generate(prompts[3], params(structured=StructuredOutputs(choice=("Paris is the capital.",))))[0]
    assert out.text == "Paris is the capital."
    assert any(lp.logprob == 0.0 and lp.top == ((lp.token, 0.0),) for lp in out.logprobs)


def test_prompt_logprobs_are_a_teacher_forced_pass(plain, prompts):
    long = plain.apply_chat_template([{"role": "user", "content": "Tell me about cats. " * 60}])  # > one chunk
    for prompt in (prompts[0], long):
        out = plain.generate(prompt, params(max_tokens=4, prompt_logprobs=2))[0]
        assert out.token_ids == plain.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
        engine = plain.engine
        with engine.blocks.scratch(-99, len(prompt)) as table:
            fwd = engine.target.forward(ForwardBatch([SeqInput(prompt, 0, table, sampled_from=0,
                                                               logits_indices=list(range(len(prompt))))]))
            expected = [None] + [row_logprob(fwd.seq_logits(0)[r], prompt[r + 1], 2) for r in range(len(prompt) - 1)]
        assert out.prompt_logprobs == expected
    assert plain.engine.blocks.num_used_blocks == 0
