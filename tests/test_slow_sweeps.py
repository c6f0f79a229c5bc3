"""Long checks, run by `make test-slow`: T=0 identity of speculation against plain decoding
over all 80 MT-bench first turns, with the server's default drafter (the datastore over
../shared/data/train, adaptive as `tercel serve` runs it, on an AMX machine's stated cost curve:
drafts are accepted wherever the sweep runs) and the n-gram drafter, on the default model and
quantization, batched as a server batches."""
from __future__ import annotations

import pytest

from conftest import SHARED_DATA, mtbench_prompts
from pinned import CHEAP_ROWS
from spec import LLM, SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(max_num_seqs=1)
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(80)]


@pytest.fixture(scope="module")
def reference(prompts):
    return [o.token_ids for o in LLM(max_num_seqs=8).generate(prompts, GREEDY)]


@pytest.mark.parametrize("drafter", [f"datastore:{SHARED_DATA / 'train'}", "ngram"])
def test_all_of_mtbench_decodes_identically_with_speculation(drafter, prompts, reference):
    llm = LLM(max_num_seqs=8, drafter=drafter, adaptive=CHEAP_ROWS)
    outs = llm.generate(prompts, GREEDY)
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, reference)) if o.token_ids != ref]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0
