"""logit_bias, min_tokens, stop tokens and what the text keeps: the transform itself, the
detokenizer's rules, and T=0 token identity with speculation on and off (the T>0 laws are in
test_logit_controls_exactness.py)."""
from __future__ import annotations

import pytest
import torch

from conftest import mtbench_prompts, slow_marked, spec_drafters
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from spec.detokenizer import IncrementalDetokenizer
from verifier.sampling.sampler import sample_token, transform_logits

V = 64


def row(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed))


# ---- the transform -------------------------------------------------------------------------
def test_logit_bias_is_added_to_the_raw_logits_and_leaves_the_input_alone():
    x = row()
    before = x.clone()
    out = transform_logits(x, SamplingParams(logit_bias={3: 2.5, 7: -100}), [], [])
    assert torch.equal(x, before)
    assert out[3] == x[3] + 2.5 and out[7] == x[7] - 100
    assert torch.equal(torch.cat([out[:3], out[4:7], out[8:]]), torch.cat([x[:3], x[4:7], x[8:]]))


def test_min_tokens_masks_the_finishing_ids_while_the_output_is_shorter():
    """Masked while len(output) < min_tokens: at 2 output tokens (a node at depth 2 below a
    root with none) the row is free again."""
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    held = params.finishing_ids({9})
    assert held == {5, 9}
    for output, masked in (([], True), ([1], True), ([1, 4], False)):
        out = transform_logits(row(), params, [], output, held)
        assert (out[[5, 9]] == float("-inf")).all() == masked
        assert torch.isfinite(out[:5]).all()


def test_ignore_eos_leaves_eos_out_of_what_min_tokens_holds_back():
    assert SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[4]).finishing_ids({2}) == {4}


def test_the_bias_comes_before_the_penalties():
    """As vLLM: a repetition penalty divides the biased logit, not the raw one."""
    x = torch.zeros(V)
    x[3] = 2.0
    out = transform_logits(x, SamplingParams(logit_bias={3: 2.0}, repetition_penalty=2.0), [3], [])
    assert out[3] == pytest.approx(2.0)


def test_greedy_sampling_follows_the_bias():
    x = row(1)
    target = int(x.argmin())
    assert sample_token(x, SamplingParams(temperature=0, logit_bias={target: 100}), [], [], None) == target


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={3: 100.5}), "in \\[-100, 100\\]"),
    (dict(logit_bias={-1: 1.0}), "token ids"),
    (dict(logit_bias={"3": 1.0}), "token ids"),
    (dict(logit_bias={3: "x"}), "number"),
    (dict(min_tokens=-1), "min_tokens must be an int"),
    (dict(min_tokens=5, max_tokens=4), "must not exceed"),
])
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_with_a_constraint_is_refused():
    from verifier.sampling.structured import StructuredOutputs
    with pytest.raises(ValueError, match="output constraint"):
        SamplingParams(min_tokens=1, structured=StructuredOutputs(regex="a+"))


def test_a_bias_past_the_vocabulary_is_refused_before_the_request_queues(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="below the vocabulary size 49152"):
        llm.generate([5, 6], SamplingParams(logit_bias={49152: 1.0}))
    assert not llm.engine.requests


def test_the_bias_is_frozen_into_sorted_pairs():
    a, b = SamplingParams(logit_bias={7: 1.0, 3: -2}), SamplingParams(logit_bias=[(3, -2), (7, 1.0)])
    assert a.logit_bias == b.logit_bias == ((3, -2), (7, 1.0)) and hash(a) == hash(b)


# ---- the text ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from verifier.model.tokenizer import Tokenizer
    return Tokenizer(smollm2_dir)


def feed(d: IncrementalDetokenizer, ids: list[int]) -> str:
    """Token by token as the engine adds them, the deltas joined."""
    out = ""
    for i in range(1, len(ids) + 1):
        d.add(ids[:i])
        out += d.take_delta(False)
        if d.stopped_by:
            break
    d.flush(ids[:i])
    return out + d.take_delta(True)


def test_include_stop_str_in_output_keeps_the_stop_string(tok):
    ids = tok.encode(" one two three four", add_special_tokens=False)
    assert feed(IncrementalDetokenizer(tok, stop=("three",)), ids) == " one two "
    assert feed(IncrementalDetokenizer(tok, stop=("three",), include_stop=True), ids) == " one two three"


def test_the_finishing_tokens_text_is_left_out_unless_asked(tok):
    ids = tok.encode(" one two three", add_special_tokens=False)
    three = ids[-1]
    plain = IncrementalDetokenizer(tok, finishing_ids=frozenset({three}))
    kept = IncrementalDetokenizer(tok, finishing_ids=frozenset({three}), include_stop=True)
    assert feed(plain, ids) == " one two" and feed(kept, ids) == " one two three"


def test_special_tokens_are_shown_when_skip_special_tokens_is_off(tok):
    ids = tok.encode("<|im_start|>assistant hi", add_special_tokens=False)
    assert feed(IncrementalDetokenizer(tok), ids) == "assistant hi"
    assert feed(IncrementalDetokenizer(tok, skip_special_tokens=False), ids) == "<|im_start|>assistant hi"


def test_stop_strings_count_only_past_min_tokens(tok):
    """A stop string inside the first min_tokens tokens is passed over; one after them stops."""
    ids = tok.encode(" stop a b c stop d e", add_special_tokens=False)
    assert feed(IncrementalDetokenizer(tok, stop=("stop",)), ids) == " "
    assert feed(IncrementalDetokenizer(tok, stop=("stop",), min_tokens=2), ids) == " stop a b c "


# ---- T=0: speculation changes nothing --------------------------------------------------------
NEW = 32
DRAFTERS = spec_drafters()


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=4)


@pytest.fixture(scope="module")
def chats(plain):
    return [plain.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(2)]


@pytest.fixture(scope="module")
def short_chat(plain):
    """A question answered in a few tokens: EOS comes early, which min_tokens holds back."""
    return plain.apply_chat_template([{"role": "user", "content": "Answer with one word: is the sky blue?"}])


@pytest.fixture(scope="module")
def controls(plain, chats, short_chat):
    """Per case, the params and plain decoding's outputs. The bias bans the reference's third
    token of each reply, and pushes " the" up; min_tokens keeps a short answer going past EOS."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    reference = [o.token_ids for o in plain.generate(chats, greedy)]
    the = plain.tokenizer.encode(" the", add_special_tokens=False)[0]
    bias = {**{ids[2]: -100 for ids in reference}, the: 3.0}
    short = plain.generate(short_chat, SamplingParams(temperature=0, max_tokens=NEW))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 12      # the unconstrained answer is short
    cases = {"logit_bias": (chats, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias=bias)),
             "min_tokens": ([short_chat], SamplingParams(temperature=0, max_tokens=NEW, min_tokens=20))}
    out = {name: (prompts, params, [o.token_ids for o in plain.generate(prompts, params)])
           for name, (prompts, params) in cases.items()}
    assert all(a != b for a, b in zip(out["logit_bias"][2], reference))       # the bias changed every reply
    assert all(len(ids) >= 20 for ids in out["min_tokens"][2])
    return out


# `make test` runs the small drafter (its own q follows the bias and min_tokens); each case costs 40-60 s here.
@pytest.mark.parametrize("name", slow_marked(["small", "ngram", "suffix", "tree"], {"ngram", "suffix", "tree"}))
def test_greedy_speculation_is_token_identical_under_the_controls(name, controls, plain):
    """Each drafter on SmolLM2, whole trees: the biased replies and the ones held past EOS by
    min_tokens are plain greedy decoding's, and drafts were accepted along them."""
    drafter, spec = DRAFTERS[name]
    llm = LLM(max_num_seqs=4, drafter=drafter, speculation=spec, adaptive=AdaptiveConfig(enabled=False))
    accepted = 0
    for case, (prompts, params, expected) in controls.items():
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, case
        accepted += sum(o.stats.accepted_tokens for o in outs)
    assert accepted > 0 and llm.engine.blocks.num_used_blocks == 0


def test_a_stop_token_inside_an_accepted_path_waits_for_min_tokens(tiny_llama_dir):
    """The tiny model drafting for itself (long accepted paths): a stop token id that plain
    decoding meets early is masked until min_tokens, with speculation as without."""
    from drafters.config import SpecConfig
    kw = dict(max_model_len=256, num_kv_blocks=96, max_num_seqs=4)
    plain_llm = LLM(str(tiny_llama_dir), **kw)
    spec_llm = LLM(str(tiny_llama_dir), drafter=f"small:{tiny_llama_dir}", speculation=SpecConfig(4),
                   adaptive=AdaptiveConfig(enabled=False), **kw)
    prompt = list(range(100, 140))
    full = plain_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full[3]], min_tokens=10)
    a, b = plain_llm.generate(prompt, params)[0], spec_llm.generate(prompt, params)[0]
    assert a.token_ids == b.token_ids and b.stats.accepted_tokens > 0
    assert len(a.token_ids) > 10 and full[3] not in a.token_ids[:10]
