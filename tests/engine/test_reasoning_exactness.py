"""A constraint held after a reasoning block (serving/reasoning.py:after_reasoning) is a grammar
like any other to the engine: at T=0 every drafter gives plain decoding's tokens across the
block's end, where the free text turns into the constrained answer. The prompts show earlier
answers with a `<think>` block, so the default model (its dense weights) writes one and closes it.
A thinking budget (verifier/sampling/thinking.py) closes it early, every drafter alike."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from conftest import slow_marked, spec_drafters
from pinned import untuned_dense_linears
from serving.reasoning import DEEPSEEK_R1, END, QWEN3, after_reasoning, split_reasoning
from spec import LLM, SamplingParams, StructuredOutputs
from spec.adaptive import AdaptiveConfig
from verifier.sampling.thinking import ThinkingBudget

DRAFTERS = spec_drafters()
SHOTS = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
         "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n<think>\nOne plus one is two.\n"
         "</think>\n\n2<|im_end|>\n<|im_start|>user\nWhat is 4+4?<|im_end|>\n<|im_start|>assistant\n<think>\n"
         "Four plus four is eight.\n</think>\n\n8<|im_end|>\n")
QUESTIONS = ("What is 2+3?", "What is 3+5?", "What is 10-4?")
# Dense weights on their untuned matmul split: that the model writes and closes a block must not depend
# on which int4 kernel or matmul library this machine's timings chose (the drafters' own weights may
# be anything: they only propose).
DENSE = "none"
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.fixture(scope="module", autouse=True)
def _untuned_dense_linears():
    with untuned_dense_linears():
        yield


def prompts(fmt) -> list[str]:
    opened = "<think>\n" if fmt is DEEPSEEK_R1 else ""
    return [f"{SHOTS}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{opened}" for q in QUESTIONS]


def params(fmt) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=48, structured=after_reasoning(fmt, StructuredOutputs(json=ANSWER)))


def drafting_llm(name: str, replies: list, tmp_path) -> LLM:
    """The default model's dense weights with drafter `name` verifying whole trees; a datastore
    drafter's corpus is `replies` (outputs), written under tmp_path."""
    drafter, spec = DRAFTERS[name]
    if "{corpus}" in drafter:
        corpus = tmp_path / "replies.jsonl"
        corpus.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": "q"},
                                                                {"role": "assistant", "content": o.text}]}) + "\n"
                                  for o in replies))
        drafter = drafter.format(corpus=corpus)
    return LLM(max_num_seqs=4, drafter=drafter, speculation=spec, adaptive=AdaptiveConfig(enabled=False),
               quantization=DENSE)


@pytest.fixture(scope="module")
def reference():
    plain = LLM(max_num_seqs=4, drafter=None, quantization=DENSE)
    return {fmt.name: plain.generate(prompts(fmt), params(fmt)) for fmt in (QWEN3, DEEPSEEK_R1)}


def test_plain_decoding_reasons_then_answers_in_the_schema(reference):
    for name, outs in reference.items():
        fmt = QWEN3 if name == "qwen3" else DEEPSEEK_R1
        for out in outs:
            split = split_reasoning(fmt, out.text)
            assert split.reasoning, out.text
            jsonschema.validate(json.loads(split.content), ANSWER)


# `make test` runs the tree (a small model and n-gram merged); each other drafter under `make test-slow`.
@pytest.mark.parametrize("name", slow_marked(DRAFTERS, set(DRAFTERS) - {"tree"}))
def test_every_drafter_is_token_identical_across_the_block_s_end(name, reference, tmp_path):
    llm = drafting_llm(name, [o for outs in reference.values() for o in outs], tmp_path)
    for fmt in (QWEN3, DEEPSEEK_R1):
        outs = llm.generate(prompts(fmt), params(fmt))
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference[fmt.name]], fmt.name
        assert sum(o.stats.accepted_tokens + o.stats.forced_tokens for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0


BUDGET = 4          # reasoning tokens before the block's end is forced: the shots' blocks run longer


def budgeted(llm) -> SamplingParams:
    """deepseek_r1's block (opened by the template) held to BUDGET tokens, then the answer's schema."""
    end = tuple(llm.tokenizer.encode(END, add_special_tokens=False))
    return dataclasses.replace(params(DEEPSEEK_R1), thinking=ThinkingBudget(BUDGET, end_ids=end))


@pytest.fixture(scope="module")
def budget_reference():
    plain = LLM(max_num_seqs=4, drafter=None, quantization=DENSE)
    p = budgeted(plain)
    return plain.generate(prompts(DEEPSEEK_R1), p), p


def test_a_spent_thinking_budget_ends_the_block_and_the_answer_follows_in_the_schema(budget_reference):
    outs, p = budget_reference
    for out in outs:
        assert out.token_ids[BUDGET:BUDGET + len(p.thinking.end_ids)] == list(p.thinking.end_ids), out.text
        split = split_reasoning(DEEPSEEK_R1, out.text)
        assert split.reasoning is not None and END not in split.reasoning
        jsonschema.validate(json.loads(split.content), ANSWER)


# `make test` runs the tree; each other drafter under `make test-slow`.
@pytest.mark.parametrize("name", slow_marked(DRAFTERS, set(DRAFTERS) - {"tree"}))
def test_every_drafter_is_token_identical_under_a_thinking_budget(name, budget_reference, tmp_path):
    llm = drafting_llm(name, budget_reference[0], tmp_path)
    outs = llm.generate(prompts(DEEPSEEK_R1), budget_reference[1])
    assert [o.token_ids for o in outs] == [o.token_ids for o in budget_reference[0]]
    assert sum(o.stats.accepted_tokens + o.stats.forced_tokens for o in outs) > 0
    assert llm.engine.blocks.num_used_blocks == 0
