"""Speculative decoding inside the engine: T=0 identity with plain decoding for every
drafter on SmolLM2, stops and max_tokens inside accepted paths, seeds, and no leaked
KV blocks after cancellations and preemptions."""
from __future__ import annotations

import json
import random

import pytest

from conftest import (IDENTITY_ALONE as ALONE, drive_random_requests, mtbench_prompts, slow_marked,
                      spec_drafters, write_reply_corpus)
from drafters.config import SpecConfig
from pinned import CHEAP_ROWS
from spec.adaptive import AdaptiveConfig
from spec import LLM, SamplingParams, Submission

NEW = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
DRAFTERS = spec_drafters()


@pytest.fixture(scope="module")
def plain():
    return LLM(max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template([{"role": "user", "content": p}]) for p in mtbench_prompts(8)]


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return [o.token_ids for o in plain.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plain, reference):
    """The plain replies as a conversation file: the datastore drafter's corpus."""
    return write_reply_corpus(tmp_path_factory.mktemp("corpus") / "replies.jsonl", plain, reference)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_speculation_is_token_identical(name, prompts, reference, corpus):
    """8 MT-bench prompts x 48 tokens as a batch of 8, and the first 2 one at a time: the same
    tokens as plain greedy decoding; the drafter is really used (tokens accepted: whole trees,
    which the adaptive controller would cut where they do not pay)."""
    drafter, spec = DRAFTERS[name]
    llm = LLM(max_num_seqs=8, drafter=drafter.format(corpus=corpus), speculation=spec,
              adaptive=AdaptiveConfig(enabled=False))
    alone = [llm.generate(p, GREEDY)[0] for p in prompts[:ALONE]]
    batch = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in alone] == reference[:ALONE]
    assert [o.token_ids for o in batch] == reference
    accepted = sum(o.stats.accepted_tokens for o in alone + batch)
    steps = sum(o.stats.verify_steps for o in alone + batch)
    print(f"{name}: {accepted} accepted in {steps} verify steps, "
          f"mean accepted length {sum(o.stats.emitted_tokens for o in batch) / max(1, sum(o.stats.verify_steps for o in batch)):.2f}")
    assert accepted > 0
    assert llm.engine.blocks.num_used_blocks == 0


def test_suffix_decoding_under_the_cost_model_is_token_identical(prompts, reference):
    """Suffix decoding with the adaptive controller on: its cuts follow the cost curve and past
    acceptance, the cross-request cache the earlier replies (the batch repeats the prompts run
    alone first), and the tokens stay plain greedy decoding's. The curve is an AMX machine's,
    stated: on one timed where rows are dear the cached replies might not be drafted."""
    llm = LLM(max_num_seqs=8, drafter="suffix", adaptive=CHEAP_ROWS)
    alone = [llm.generate(p, GREEDY)[0] for p in prompts[:ALONE]]
    batch = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in alone] == reference[:ALONE]
    assert [o.token_ids for o in batch] == reference
    assert sum(o.stats.accepted_tokens for o in batch[:ALONE]) > 0     # the cached replies were drafted
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_spec(tiny_llama_dir):
    """Tiny random Llama drafting for itself: acceptance is high, so paths are long. Whole
    trees: these tests need accepted paths, which the adaptive controller may judge not
    worth their rows on a busy machine."""
    return LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=96, max_num_seqs=8,
               drafter=f"small:{tiny_llama_dir}", speculation=SpecConfig(num_speculative_tokens=4),
               adaptive=AdaptiveConfig(enabled=False))


@pytest.fixture(scope="module")
def tiny_plain(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=96, max_num_seqs=8)


def test_a_request_without_speculation_decodes_plainly_on_a_drafting_engine(tiny_spec, tiny_plain):
    """`generate(..., speculate=False)`: no draft token verified, the plain engine's tokens."""
    p = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = tiny_plain.generate(p, params)[0].token_ids
    off = tiny_spec.generate(p, params, speculate=False)[0]
    on = tiny_spec.generate(p, params)[0]
    assert off.token_ids == on.token_ids == want
    assert off.stats.draft_tokens == 0 and on.stats.draft_tokens > 0


def test_max_tokens_never_exceeded_inside_accepted_paths(tiny_spec, tiny_plain):
    """For max_tokens 1..12 the output has exactly max_tokens tokens, equal to the plain prefix."""
    p = list(range(100, 140))
    full = tiny_plain.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    for n in range(1, 13):
        out = tiny_spec.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == full[:n] and out.finish_reason == "length"


def test_stop_string_and_stop_token_inside_accepted_paths(tiny_spec, tiny_plain):
    """Stops that fall inside an accepted path end the request exactly where plain decoding does."""
    p = list(range(200, 240))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = tiny_plain.generate(p, params)[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    with_stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                               stop_token_ids=[full.token_ids[30]])
    a, b = tiny_plain.generate(p, with_stop)[0], tiny_spec.generate(p, with_stop)[0]
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert b.stats.accepted_tokens > 0 and b.finish_reason == "stop"


def test_seeded_sampling_reproduces_under_speculation(tiny_spec):
    """Same seed, same speculative configuration: the same sampled tokens."""
    p = list(range(300, 330))
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=42, ignore_eos=True)
    first = tiny_spec.generate(p, params)[0]
    assert tiny_spec.generate(p, params)[0].token_ids == first.token_ids
    assert first.stats.verify_steps > 0


def test_stats_are_consistent(tiny_spec):
    """mean_accepted_length = emitted / verify steps; per-depth acceptance never increases with depth."""
    out = tiny_spec.generate(list(range(400, 440)), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    st = out.stats
    assert st.mean_accepted_length == pytest.approx(st.emitted_tokens / st.verify_steps)
    assert st.accepted_tokens == sum(st.accepted_per_depth)
    assert all(a >= b for a, b in zip(st.accepted_per_depth, st.accepted_per_depth[1:]))
    assert 1.0 <= st.mean_accepted_length <= 5.0


# `make test` runs the drafters that hold KV of their own: the tree (a small model beside n-gram) and
# EAGLE-3; the lookups (n-gram, datastore, suffix) and the small model alone under `make test-slow`.
@pytest.mark.parametrize("drafter", slow_marked(["small", "ngram", "tree", "eagle3", "datastore", "suffix"],
                                                {"small", "ngram", "datastore", "suffix"}))
def test_no_leaked_blocks_after_speculative_requests_with_cancellations(tiny_llama_dir, tiny_eagle_head, drafter,
                                                                        tmp_path):
    """100 speculative requests, random aborts and a pool small enough to preempt: integrity
    after every step, and afterwards both the target's and the drafter's pools are whole. The
    controller cuts trees on a stated curve: the steps, and so the random requests, never
    follow this machine's timings."""
    spec = {"small": f"small:{tiny_llama_dir}", "ngram": "ngram", "tree": f"tree:small:{tiny_llama_dir}+ngram",
            "eagle3": f"eagle3:{tiny_eagle_head}", "datastore": f"datastore:{tmp_path / 'c.jsonl'}",
            "suffix": "suffix"}[drafter]
    (tmp_path / "c.jsonl").write_text(json.dumps({"conversations": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "the cat sat on the mat " * 20}]}))
    llm = LLM(str(tiny_llama_dir), max_model_len=160, num_kv_blocks=48, block_size=8, max_num_seqs=8,
              drafter=spec, speculation=SpecConfig(num_speculative_tokens=3, topk=2), adaptive=CHEAP_ROWS)
    engine, rng = llm.engine, random.Random(7)

    def make(i):
        base = [rng.randrange(3, 400)] * 4 + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))]
        return base, SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(1, 50),
                                    ignore_eos=True)

    _, preempted = drive_random_requests(engine, rng, 100, make, add_p=0.6, abort_p=0.08)
    assert preempted > 0
    assert engine.blocks.num_used_blocks == 0 and not engine.requests
    for part in getattr(engine.drafter, "parts", [engine.drafter]):
        if hasattr(part, "blocks"):
            part.blocks.check_integrity()
            assert part.blocks.num_used_blocks == 0
        assert not getattr(part, "state", {}), "drafter state of finished requests must be released"
        if hasattr(part, "served"):      # suffix decoding: every output it holds is a finished one's
            assert len(part.served.seqs) == part.cached_outputs > 0


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, tiny_llama_dir):
    """A draft checkpoint whose vocabulary differs from the target's is a clear error."""
    from conftest import make_tiny_model
    other = make_tiny_model(tmp_path / "other", None)          # 256-token vocab, no tokenizer
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=16, drafter=f"small:{other}")


def test_unknown_drafter_is_refused(tiny_llama_dir):
    """An unknown drafter kind names the known ones."""
    with pytest.raises(ValueError, match="unknown drafter 'medusa'.*ngram.*small.*tree"):
        LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=16, drafter="medusa")


def test_drafter_prefills_in_the_targets_chunks(tiny_llama_dir, tiny_plain):
    """With a 16-token prefill budget, the small drafter's KV advances chunk by chunk with the
    target's, and the output still equals plain greedy decoding."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=16,
              drafter=f"small:{tiny_llama_dir}", speculation=SpecConfig(num_speculative_tokens=3))
    engine, prompt = llm.engine, list(range(500, 560))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    req = engine.add_request("chunked", Submission(prompt, params))
    seen = []
    while req.num_computed_tokens < len(prompt):
        engine.step()
        seen.append((req.num_computed_tokens, engine.drafter.state[req.seq_id].computed))
    assert seen[:3] == [(16, 16), (32, 32), (48, 48)]
    out = None
    while engine.has_unfinished:
        for o in engine.step():
            out = o
    assert out.token_ids == tiny_plain.generate(prompt, params)[0].token_ids
