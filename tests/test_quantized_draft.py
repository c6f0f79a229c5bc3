"""A draft model on its file's own int4 blocks: beside a dense target (the same GGUF served
in fp32), and its short catch-up chunks on the sampled rows' kernel."""
from __future__ import annotations

import pytest
import torch

from conftest import mtbench_prompts
from pinned import CHEAP_ROWS
from spec import LLM, SamplingParams
from verifier.batch import ForwardBatch, SeqInput
from verifier.quantized.matmul_paths import KernelPlan, KernelTimings
from verifier.quantized.qlinear import DENSE_PATHS

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Prompt rows on a dense path, sampled rows (and chunks under 8 rows) on torch's int4 kernel.
STATED_PLAN = KernelPlan(DENSE_PATHS[0], tile=0, own="int4", own_below=8)


@pytest.fixture(scope="module")
def dense():
    return LLM(max_num_seqs=2, quantization="none")


def test_a_dense_target_drafts_with_its_int4_self_and_keeps_its_tokens(dense):
    """The fp32 target verifying its own GGUF's int4 blocks as the draft model: the draft runs
    int4, drafts the chain length the adaptive controller asks each step (up to the default
    8, on an AMX machine's stated cost curve), its chains are almost always accepted, and the
    tokens are plain fp32 decoding's."""
    prompts = [dense.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(2)]
    want = [o.token_ids for o in dense.generate(prompts, GREEDY)]
    llm = LLM(max_num_seqs=2, quantization="none", drafter="small:smollm2-135m-instruct", adaptive=CHEAP_ROWS)
    engine = llm.engine
    assert engine.drafter.model.quantization == "int4" and engine.target.quantization == "none"
    asked, drafted = [], []
    ask, propose = engine.adaptive.nodes_to_draft, engine.drafter.propose
    engine.adaptive.nodes_to_draft = lambda *a: asked.append(ask(*a)) or asked[-1]
    engine.drafter.propose = lambda views: drafted.extend(v.max_depth for v in views) or propose(views)
    outs = llm.generate(prompts, GREEDY)
    del engine.adaptive.nodes_to_draft, engine.drafter.propose    # no cycle left to outlive the test
    assert [o.token_ids for o in outs] == want
    assert max(asked) == 8 and 0 < len(drafted) <= len(asked)          # none asked of: near max_tokens
    assert set(drafted) <= set(range(1, 9)) and drafted.count(8) > len(drafted) // 2
    steps = sum(o.stats.verify_steps for o in outs)
    assert sum(o.stats.emitted_tokens for o in outs) >= 3 * steps      # τ >= 3 of at most 7
    assert llm.engine.blocks.num_used_blocks == 0


def _forward(engine, ids: list[int], sampled: list[int], chunk_invariant: bool) -> torch.Tensor:
    """Logits of `sampled` rows of `ids` as one prompt chunk in the idle engine's blocks (freed after)."""
    target, blocks, seq = engine.target, engine.blocks, 10**9
    blocks.allocate(seq, ids)
    try:
        batch = ForwardBatch([SeqInput(ids, 0, blocks.block_table(seq), logits_indices=sampled)])
        return target.forward(batch, chunk_invariant=chunk_invariant).logits
    finally:
        blocks.free(seq)


def test_a_short_chunk_runs_on_the_own_kernel_only_where_chunking_may_change_its_kv(monkeypatch):
    """`chunk_invariant=False`: a chunk with fewer prompt rows than the plan's `own_below` runs
    whole on the own kernel (bitwise what it gives with every row sampled); a longer one, and
    any chunk by default, still splits (bitwise the default forward). The plan is stated: the one
    timed here may take every prompt row to the bulk path, or none."""
    monkeypatch.setattr(KernelTimings, "plan", lambda self, owns: STATED_PLAN)
    llm = LLM(max_num_seqs=1)
    engine, target = llm.engine, llm.engine.target
    below = target.runner.plan.own_below
    assert target.runner.plan == STATED_PLAN
    short = engine.tokenize("The capital of France is")[: below - 1]
    whole = _forward(engine, short, list(range(len(short))), True)[-1]
    fast = _forward(engine, short, [len(short) - 1], False)[0]
    assert torch.equal(fast, whole)
    split = _forward(engine, short, [len(short) - 1], True)[0]
    assert not torch.equal(split, whole) or target.runner.plan.bulk == target.runner.plan.own
    long = (engine.tokenize("one two three four five six seven eight nine ten ") * 64)[:below + 2]
    assert torch.equal(_forward(engine, long, [len(long) - 1], False), _forward(engine, long, [len(long) - 1], True))
