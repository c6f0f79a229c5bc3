"""Structured outputs (verifier/sampling/grammar.py, spec/constraints.py) on SmolLM2: constraints are
compiled and refused as they should be, tree masks and pruning follow the grammar, and at
T=0 jump-forward and every drafter give exactly the tokens of plain constrained decoding,
alone and batched. T > 0 exactness: test_structured_exactness.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from bench.structured import load_tasks
from conftest import IDENTITY_ALONE as ALONE, slow_marked, spec_drafters, write_reply_corpus
from pinned import WHOLE_TREES
from spec import LLM, SamplingParams, StructuredOutputs, Submission
from spec.constraints import kept_nodes
from tree.token_tree import TokenTree
from verifier.sampling.grammar import GrammarBackend, allowed_tokens, sole_tokens

TASKS = load_tasks(8)
DRAFTERS = spec_drafters()
NEW = 128


def constrained(task, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, structured=StructuredOutputs(json=task.schema), **kw)


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8, jump_forward=False)


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template(t.messages()) for t in TASKS]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    """Plain constrained decoding: one token per step, no jump-forward, no drafter."""
    return [plain.generate(p, constrained(t))[0] for p, t in zip(prompts, TASKS)]


@pytest.fixture(scope="module")
def backend(plain):
    return plain.engine.grammars


# ---- constraints and their compilation ---------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one"),
    ({"regex": "a+", "grammar": 'root ::= "a"'}, "exactly one"),
    ({"regex": ""}, "non-empty"),
    ({"choice": []}, "non-empty"),
])
def test_a_constraint_names_exactly_one_kind(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kw)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "objec"}), r"invalid JSON schema: .*objec"),
    (StructuredOutputs(json="{not json"), "invalid JSON schema"),
    (StructuredOutputs(regex="a(b"), r"invalid regular expression: .*parenthesis"),
    (StructuredOutputs(grammar='root ::= "a" | b'), r"invalid grammar: .*Rule \"b\" is not defined"),
])
def test_a_bad_constraint_is_a_value_error_naming_it(backend, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        backend.compile(spec)
    assert "/project/" not in str(info.value)        # xgrammar's source path is not the user's business


def test_compiled_grammars_are_cached(backend):
    spec = StructuredOutputs(json=TASKS[0].schema)
    assert backend.compile(spec) is backend.compile(StructuredOutputs(json=dict(TASKS[0].schema)))


def test_a_model_without_a_vocabulary_refuses_constraints():
    from verifier.model.tokenizer import NullTokenizer
    with pytest.raises(ValueError, match="no tokenizer"):
        GrammarBackend(NullTokenizer(), 256, [2]).compile(StructuredOutputs(regex="a"))


def test_a_bad_constraint_leaves_no_request_behind(plain, prompts):
    with pytest.raises(ValueError, match="invalid regular expression"):
        plain.engine.add_request("bad", Submission(prompts[0], SamplingParams(structured=StructuredOutputs(regex="("))))
    assert "bad" not in plain.engine.requests and not plain.engine.has_unfinished


# ---- masks, pruning, forced tokens -------------------------------------------------------
def test_tree_masks_follow_each_path_and_prune_what_leaves_the_grammar(backend, plain):
    tok = plain.tokenizer
    m = backend.matcher(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"], "additionalProperties": False}))
    brace, a, close = (tok.encode(s, add_special_tokens=False)[0] for s in ('{"', "a", '":'))
    word = tok.encode(" hello", add_special_tokens=False)[0]
    assert m.accept(brace)
    # root (the last token, '{"') -> a -> '":' ; root -> " hello" (not allowed) -> a
    tree = TokenTree((brace, a, word, close, a), (-1, 0, 0, 1, 2))
    masks = m.tree_masks(tree)
    assert kept_nodes(tree, masks) == [True, True, False, True, False]
    allowed = allowed_tokens(masks, plain.engine.target.config.vocab_size)
    assert allowed[0, a] and not allowed[0, word]          # the root row: the current state
    assert allowed[1, close] and not allowed[1, a]         # after "a": its closing quote
    assert not allowed[2].any() and not allowed[4].any()   # never visited
    pruned, old = tree.pruned(kept_nodes(tree, masks))
    assert old == [0, 1, 3] and pruned.tokens == (brace, a, close) and pruned.parents == (-1, 0, 1)
    assert m.forced(8) and m.accept(a)                    # the walk left the state where it was


def test_forced_tokens_spell_the_fixed_text_and_end_with_the_stop_token(backend, plain):
    tok = plain.tokenizer
    m = backend.matcher(StructuredOutputs(json={"type": "object", "properties": {"name": {"type": "string"}},
                                                "required": ["name"], "additionalProperties": False}))
    # The fixed text is '{"name": "'; its last token is left out when a longer token starts
    # with it (here ' "' is the start of ' "a', ...): the model chooses how to spell on.
    assert tok.decode(m.forced(16)) == '{"name":'
    assert tok.decode(m.forced(2)) == '{"name'               # at most the limit
    for t in tok.encode('{"name": "Bo"}', add_special_tokens=False):
        assert m.accept(t)
    assert m.forced(4) == [plain.tokenizer.eos_token_id]      # only the stop token may follow


# ---- the engine ------------------------------------------------------------------------
def test_plain_constrained_outputs_validate_against_their_schemas(reference):
    for task, out in zip(TASKS, reference):
        assert out.finish_reason == "stop", (task.id, out.text)
        jsonschema.validate(json.loads(out.text), task.schema)
        assert out.stats.forced_tokens == 0 and out.stats.verify_steps == 0


def test_jump_forward_without_a_drafter_is_token_identical_and_takes_forced_stretches(prompts, reference):
    llm = LLM(max_num_seqs=8)
    alone = [llm.generate(p, constrained(t))[0] for p, t in zip(prompts, TASKS)]
    batch = llm.generate(prompts, [constrained(t) for t in TASKS])
    assert [o.token_ids for o in alone] == [o.token_ids for o in reference]
    assert [o.token_ids for o in batch] == [o.token_ids for o in reference]
    forced = sum(o.stats.forced_tokens for o in alone)
    total = sum(len(o.token_ids) for o in alone)
    print(f"jump-forward: {forced} of {total} tokens forced")
    assert forced > total // 5
    assert all(o.stats.verify_steps == 0 for o in alone)     # forced chains are not drafter steps
    assert llm.engine.blocks.num_used_blocks == 0


def test_every_output_token_runs_as_a_sampled_row(plain, prompts, monkeypatch):
    """A decode step whose grammar allows one token asks for no logits, and still runs on the
    quantized target's row-invariant kernels: the same token inside a jump-forward chain or a
    draft tree does, and its KV must be the same bits either way. (Run as a prompt row, then on
    the dense path, it was not: T=0 outputs with and without jump-forward drifted apart at a near-tie.)
    Only prompt tokens before the last take the prompt-row path."""
    runner, prompt_rows = plain.engine.target.runner, []
    run = runner.forward_rows

    def spy(sub, kv, own):
        prompt_rows.extend(s.ctx_len + s.num_new for s in sub.seqs if not own)
        return run(sub, kv, own=own)
    monkeypatch.setattr(runner, "forward_rows", spy)
    plain.engine.reset_prefix_cache()
    out = plain.generate(prompts[0], constrained(TASKS[0]))[0]
    matcher, decided = plain.engine.grammars.matcher(StructuredOutputs(json=TASKS[0].schema)), 0
    for t in out.token_ids:                 # the output has steps whose grammar allows one token
        decided += sole_tokens(matcher.mask())[0] >= 0
        matcher.accept(t)
    assert decided > 0 and prompt_rows and max(prompt_rows) == len(prompts[0]) - 1


def test_rows_whose_mask_allows_few_tokens_ask_for_those_logits_alone(plain, prompts, reference, monkeypatch):
    """few_allowed lists a row's tokens where they are at most 1/64 of the vocabulary; a
    constrained request sends them with its forwards (the target then skips the vocabulary
    scan for those rows), and its output stays plain constrained decoding's (the reference)."""
    from verifier.sampling.grammar import few_allowed
    masks = torch.zeros(3, 4, dtype=torch.int32)
    masks[0, 1] = 0b1001                                   # tokens 32 and 35
    masks[1] = -1                                          # all 128
    masks[2, 3] = -2 ** 31                                 # token 127 (the sign bit)
    got = few_allowed(masks, [0, 1, 2], vocab_size=100 * 64)     # at most 100 tokens
    assert got[0].tolist() == [32, 35] and got[1] is None and got[2].tolist() == [127]
    assert few_allowed(masks, [1], vocab_size=100 * 64) is None
    target, sent = plain.engine.target, []
    forward = target.forward

    def spy(batch):
        sent.extend(t for s in batch.seqs for t in (s.logits_tokens or ()) if t is not None)
        return forward(batch)
    monkeypatch.setattr(target, "forward", spy)
    out = plain.generate(prompts[1], constrained(TASKS[1]))[0]
    assert sent and all(0 < len(t) <= target.config.vocab_size // 64 for t in sent)
    assert out.token_ids == reference[1].token_ids


def test_a_drafter_that_drafts_ahead_extends_the_forced_chain(prompts, reference, monkeypatch):
    """n-gram drafts from tokens alone: in a constrained step its tree goes below the forced
    chain (one verify step for both), and the outputs stay those of plain decoding. Whole trees:
    where a verify row is dear the cost model never drafts below the chain."""
    llm = LLM(max_num_seqs=8, drafter="ngram", adaptive=WHOLE_TREES)
    grafted, accept = [], llm.engine._accept

    def spy(plans):
        grafted.extend(p.proposal.num_draft_nodes - p.forced for p in plans if p.forced and p.proposal is not None)
        return accept(plans)
    monkeypatch.setattr(llm.engine, "_accept", spy)
    alone = [llm.generate(p, constrained(t))[0] for p, t in zip(prompts, TASKS)]
    assert [o.token_ids for o in alone] == [o.token_ids for o in reference]
    assert any(n > 0 for n in grafted), "no drafter node below a forced chain"
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plain, reference):
    return write_reply_corpus(tmp_path_factory.mktemp("corpus") / "replies.jsonl", plain,
                              [o.token_ids for o in reference])


# `make test` runs the tree (a small model and n-gram merged); each other drafter under `make test-slow`.
@pytest.mark.parametrize("name", slow_marked(DRAFTERS, set(DRAFTERS) - {"tree"}))
def test_every_drafter_with_jump_forward_is_token_identical(name, prompts, reference, corpus):
    drafter, spec = DRAFTERS[name]
    llm = LLM(max_num_seqs=8, drafter=drafter.format(corpus=corpus), speculation=spec)
    alone = [llm.generate(p, constrained(t))[0] for p, t in zip(prompts[:ALONE], TASKS)]
    batch = llm.generate(prompts, [constrained(t) for t in TASKS])
    assert [o.token_ids for o in alone] == [o.token_ids for o in reference[:ALONE]]
    assert [o.token_ids for o in batch] == [o.token_ids for o in reference]
    print(f"{name}: {sum(o.stats.accepted_tokens for o in alone)} drafted tokens accepted, "
          f"{sum(o.stats.forced_tokens for o in alone)} forced")
    assert sum(o.stats.forced_tokens for o in alone) > 0
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def ngram_llm():
    return LLM(max_num_seqs=8, drafter="ngram")


@pytest.mark.parametrize("engine", ["plain", "ngram+jump-forward"])
def test_regex_choice_and_grammar_constraints(engine, plain, ngram_llm):
    """Each kind of constraint, at T=0 and T=1. With jump-forward the last step is often a
    forced chain ending in the stop token, which acceptance walks past (a row after the stop
    token allows nothing: it must still give a distribution, not NaN)."""
    llm = plain if engine == "plain" else ngram_llm
    prompt = plain.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    cases = [
        (StructuredOutputs(regex=r"[A-Z][a-z]+ is the capital\."), lambda t: re.fullmatch(r"[A-Z][a-z]+ is the capital\.", t)),
        (StructuredOutputs(choice=("Paris", "Lyon", "Marseille")), lambda t: t in ("Paris", "Lyon", "Marseille")),
        (StructuredOutputs(grammar='root ::= "The answer is " city "."\ncity ::= "Paris" | "Rome"'),
         lambda t: t in ("The answer is Paris.", "The answer is Rome.")),
    ]
    for spec, ok in cases:
        for temperature in (0, 1.0):
            out = llm.generate(prompt, SamplingParams(temperature=temperature, seed=3, max_tokens=32,
                                                      structured=spec))[0]
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)


def test_constrained_and_free_requests_share_a_batch(plain, prompts, reference, ngram_llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    expected_free = plain.generate(prompts[0], free)[0].token_ids
    outs = ngram_llm.generate(prompts[:4] * 2, [constrained(t) for t in TASKS[:4]] + [free] * 4)
    assert [o.token_ids for o in outs[:4]] == [o.token_ids for o in reference[:4]]
    assert outs[4].token_ids == expected_free


# The fuzzer's case (tests/serving/test_fuzz.py): characters of unassigned planes, which xgrammar's
# matcher (pinned) walks into a state allowing no token after the first one's four bytes.
DEAD_END = "\U000d4f90\U000473ad\U00079fcc\U000251f9q"


@pytest.mark.parametrize("drafter", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_dead_end_fails_its_request_alone_with_a_clear_error(backend, tiny_llama_dir, drafter,
                                                                        temperature):
    """A state that allows no token, reached after jump-forward's chain, is the request's own
    error (invalid, naming the dead end), never a token outside the grammar; its neighbour runs on."""
    matcher = backend.matcher(StructuredOutputs(regex=DEAD_END))
    first = matcher.forced(16)
    assert [matcher.accept(t) for t in first] == [True] * len(first) and not matcher.mask().any(), \
        "the premise: the grammar dead-ends after the first character's tokens"
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=32, drafter=drafter, adaptive=WHOLE_TREES)
    dead, fine = llm.generate([[1], [1, 2, 3]], [
        SamplingParams(temperature=temperature, max_tokens=16, seed=0, structured=StructuredOutputs(regex=DEAD_END)),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    assert dead.finish_reason == "error" and dead.error.invalid and "dead end" in dead.error.message
    assert fine.finish_reason == "length" and len(fine.token_ids) == 8
    assert llm.engine.blocks.num_used_blocks == 0


def test_a_kept_node_without_tokens_is_free_only_after_the_stop_token(backend):
    """constrain(): a node that allows nothing after the stop token gets a full row (what is
    sampled there is never emitted), one after another token keeps its empty row (a dead end)."""
    from drafters.base import Proposal
    from spec.constraints import constrain
    dead = backend.matcher(StructuredOutputs(regex=DEAD_END))
    first = dead.forced(16)
    assert dead.accept(first[0])
    _, masks = constrain(Proposal(TokenTree.chain(first[0], first[1:])), dead)
    assert masks[:-1].any(-1).all() and not masks[-1].any()
    done = backend.matcher(StructuredOutputs(regex="a"))
    spelled = sole_tokens(done.mask())[0]               # the one token spelling "a"
    assert spelled >= 0 and done.accept(spelled)
    stop = done.forced(1)
    assert len(stop) == 1 and stop[0] in done.stop_ids
    _, masks = constrain(Proposal(TokenTree.chain(spelled, stop)), done)
    assert (masks[1] == -1).all()
