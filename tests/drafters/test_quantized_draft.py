"""A draft model on its file's own int4 blocks, beside a dense target (the same GGUF served
in fp32)."""
from __future__ import annotations

from conftest import mtbench_prompts
from pinned import CHEAP_ROWS
from spec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_a_dense_target_drafts_with_its_int4_self_and_keeps_its_tokens():
    """The fp32 target verifying its own GGUF's int4 blocks as the draft model: the draft runs
    int4, drafts the chain length the adaptive controller asks each step (up to the default
    8, on an AMX machine's stated cost curve), its chains are almost always accepted, and the
    tokens are plain fp32 decoding's."""
    llm = LLM(max_num_seqs=2, quantization="none", drafter="small:smollm2-135m-instruct", adaptive=CHEAP_ROWS)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(2)]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, speculate=False)]    # plain fp32 decoding
    engine = llm.engine
    assert engine.drafter.model.quantization == "int4" and engine.target.quantization == "none"
    asked, drafted = [], []
    ask, propose = engine.adaptive.nodes_to_draft, engine.drafter.propose
    engine.adaptive.nodes_to_draft = lambda *a, **kw: asked.append(ask(*a, **kw)) or asked[-1]
    engine.drafter.propose = lambda views: drafted.extend(v.max_depth for v in views) or propose(views)
    outs = llm.generate(prompts, GREEDY)
    del engine.adaptive.nodes_to_draft, engine.drafter.propose    # no cycle left to outlive the test
    assert [o.token_ids for o in outs] == want
    assert max(asked) == 8 and 0 < len(drafted) <= len(asked)          # none asked of: near max_tokens
    assert set(drafted) <= set(range(1, 9)) and drafted.count(8) > len(drafted) // 2
    steps = sum(o.stats.verify_steps for o in outs)
    assert sum(o.stats.emitted_tokens for o in outs) >= 3 * steps      # τ >= 3 of at most 7
    assert llm.engine.blocks.num_used_blocks == 0
