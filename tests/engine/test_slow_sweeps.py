"""Long checks, run by `make test-slow`: T=0 identity of speculation against plain decoding
over all 80 MT-bench first turns, with the datastore drafter over the shared training
conversations and the n-gram drafter (adaptive as `tercel serve` runs them, on an AMX machine's
stated cost curve: drafts are accepted wherever the sweep runs), on the default model and
quantization, batched as a server batches. They read the shared data folder (TERCEL_DATA,
default ../shared/data) and skip without it."""
from __future__ import annotations

import pytest

from conftest import question_rows, shared_data
from pinned import CHEAP_ROWS
from spec import LLM, SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rows = question_rows(shared_data("mtbench/question.jsonl"))
    llm = LLM(max_num_seqs=1)
    return [llm.apply_chat_template([{"role": "user", "content": r["turns"][0]}]) for r in rows[:80]]


@pytest.fixture(scope="module")
def reference(prompts):
    return [o.token_ids for o in LLM(max_num_seqs=8).generate(prompts, GREEDY)]


@pytest.mark.parametrize("drafter", ["datastore", "ngram"])
def test_all_of_mtbench_decodes_identically_with_speculation(drafter, prompts, reference):
    if drafter == "datastore":      # over the shared training conversations
        drafter = f"datastore:{shared_data('train')}"
    llm = LLM(max_num_seqs=8, drafter=drafter, adaptive=CHEAP_ROWS)
    outs = llm.generate(prompts, GREEDY)
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, reference)) if o.token_ids != ref]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0
