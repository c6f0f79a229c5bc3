"""The engine on a CUDA GPU, in bf16 with the Triton backend (`make test-gpu`).

T=0 speculation must equal plain decoding for every drafter, seeded sampling must reproduce,
and the KV pool must be whole after mixed and cancelled requests, on the default model
(SmolLM2-135M-Instruct, loaded from its GGUF as bf16 on the GPU).
"""
import random

import pytest
import torch

from conftest import (drive_random_requests, make_random_eagle_head, mtbench_prompts, spec_drafters,
                      write_reply_corpus)
from drafters.config import SpecConfig
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig

NEW = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
FIXED = AdaptiveConfig(enabled=False)     # whole trees every step, whatever drafting pays here
DRAFTERS = spec_drafters()


@pytest.fixture(scope="module")
def plain():
    llm = LLM(device="cuda", max_num_seqs=8)
    assert llm.engine.target.dtype == torch.bfloat16
    assert type(llm.engine.target.runner.backend).__name__ == "TritonBackend"
    return llm


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(8)]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return [o.token_ids for o in plain.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plain, reference):
    return write_reply_corpus(tmp_path_factory.mktemp("corpus") / "replies.jsonl", plain, reference)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculation_is_token_identical(name, prompts, reference, corpus, smollm2_dir, tmp_path):
    drafter, spec = DRAFTERS[name]
    head = make_random_eagle_head(smollm2_dir, tmp_path / "head", draft_vocab=4096) if name == "eagle3" else None
    llm = LLM(device="cuda", max_num_seqs=8, drafter=drafter.format(head=head, corpus=corpus), speculation=spec,
              adaptive=FIXED)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.verify_steps for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_seeded_sampling_reproduces(prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=i) for i in range(len(prompts))]
    llm = LLM(device="cuda", max_num_seqs=8, drafter="ngram", adaptive=FIXED)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts[:3], params[:3])]
    assert first == again
    assert alone == first[:3]


def test_kv_pool_is_whole_after_100_mixed_and_cancelled_requests(prompts):
    llm = LLM(device="cuda", max_num_seqs=8, num_kv_blocks=160, drafter="tree:small:smollm2-135m-instruct+ngram",
              speculation=SpecConfig(num_speculative_tokens=3, topk=2, budget=6), adaptive=FIXED)
    rng = random.Random(0)

    def make(i):
        temp = rng.choice([0.0, 0.7, 1.0])
        return prompts[i % len(prompts)], SamplingParams(temperature=temp, max_tokens=rng.randint(1, 48), seed=i)

    finished, _ = drive_random_requests(llm.engine, rng, 100, make, add_p=0.5, abort_p=0.1)
    assert finished > 0
    assert llm.engine.blocks.num_used_blocks == 0
