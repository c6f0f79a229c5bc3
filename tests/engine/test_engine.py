"""Engine behaviour on a tiny random Llama (SmolLM2 tokenizer): bad input, seeds, stops,
streaming, chunked prefill, preemption, prefix reuse, and a stress run with integrity checks."""
from __future__ import annotations

import dataclasses
import random

import pytest

from conftest import drive_random_requests
from spec import LLM, SamplingParams, Submission

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=8)


def assert_pool_whole(llm):
    e = llm.engine
    e.check_integrity()
    assert e.blocks.num_used_blocks == 0 and not e.scheduler.running and not e.scheduler.waiting
    assert not e.requests


def prompts(n, seed=0, lo=3, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("prompt, params, message", [
    ("", GREEDY, "prompt is empty"),
    ([[]], GREEDY, "prompt is empty"),
    ([5] * 300, GREEDY, "exceeds the context length"),
    ([5] * 200, SamplingParams(max_tokens=100), "exceeds the context length"),
    ([-1, 5], GREEDY, "token ids must be ints in"),
])
def test_bad_prompts_are_refused_and_leave_no_state(llm, prompt, params, message):
    """Empty or over-long prompts and bad token ids raise ValueError naming the problem; the pool stays whole."""
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params)
    assert_pool_whole(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(max_tokens=-3), "max_tokens must be an int >= 1"),
    (dict(temperature=-0.5), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(presence_penalty=3.0), r"presence_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be >= 0.01"),
])
def test_bad_sampling_params_name_the_allowed_range(kwargs, message):
    """Out-of-range sampling parameters raise ValueError with the allowed range."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_is_a_clear_error():
    """An unknown model name says what was looked for."""
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*alias.*gguf.*config.json"):
        LLM("no-such-model")


def test_a_bad_prompt_in_a_list_queues_nothing(llm):
    """One bad prompt among good ones: ValueError, and none of the good ones stays queued."""
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [], [8, 9]], GREEDY)
    assert_pool_whole(llm)


def test_seeded_sampling_reproduces_alone_and_in_a_batch(llm):
    """The same seed gives the same tokens, alone or batched with other requests; other seeds differ."""
    p = prompts(1, seed=3)[0]
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=seed, ignore_eos=True)  # noqa: E731
    alone = llm.generate(p, sp(7))[0].token_ids
    again = llm.generate(p, sp(7))[0].token_ids
    batched = llm.generate([prompts(1, seed=9)[0], p, p], [sp(1), sp(7), sp(8)])
    assert alone == again == batched[1].token_ids
    assert batched[2].token_ids != alone
    assert_pool_whole(llm)


def test_stop_string_cuts_text_and_finishes(llm):
    """A stop string taken from the greedy output ends generation there; the text excludes it."""
    p = prompts(1, seed=4)[0]
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert len(stop) == 3
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_max_tokens_and_eos(llm):
    """A stop token id ends with reason stop (the token kept in token_ids); max_tokens with reason length."""
    p = prompts(1, seed=5)[0]
    full = llm.generate(p, GREEDY)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == GREEDY.max_tokens
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                         stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]


def test_streamed_deltas_add_up_to_the_text(llm):
    """Concatenated per-step deltas equal the final text, and no delta holds a broken character."""
    engine = llm.engine
    engine.add_request("stream-1", Submission(prompts(1, seed=6)[0],
                                           SamplingParams(temperature=1.0, max_tokens=40, seed=1, ignore_eos=True)))
    deltas, final = [], None
    while engine.has_unfinished:
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert "".join(deltas) == final.text and final.finished
    assert all("\ufffd" not in d for d in deltas[:-1])


def test_detokenizer_never_splits_a_character(llm):
    """Multi-byte characters split across byte-level tokens are only released whole."""
    from spec.detokenizer import IncrementalDetokenizer
    tok = llm.tokenizer
    text = "Tercel 🦅 flies over 東京 and Zürich — naïve café ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # some characters span several tokens
    d = IncrementalDetokenizer(tok)
    deltas = []
    for i in range(1, len(ids) + 1):
        d.add(ids[:i])
        deltas.append(d.take_delta(False))
    d.flush(ids)
    deltas.append(d.take_delta(True))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_never_leaks_into_a_delta(llm):
    """With a stop string, text that turns out to start it is held back, not streamed."""
    from spec.detokenizer import IncrementalDetokenizer
    tok = llm.tokenizer
    ids = tok(" one two three four", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, stop=("three",))
    streamed = ""
    for i in range(1, len(ids) + 1):
        d.add(ids[:i])
        streamed += d.take_delta(False)
        if d.stopped_by:
            break
    streamed += d.take_delta(True)
    assert streamed == " one two " and d.stopped_by == "three"


def test_chunked_prefill_and_continuous_batching_keep_greedy_output(tiny_llama_dir, llm):
    """Small prefill chunks, and requests joining a running batch, give the same greedy tokens."""
    ps = prompts(6, seed=10, lo=30, hi=120)
    ref = [llm.generate(p, GREEDY)[0].token_ids for p in ps]
    chunked = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16)
    engine = chunked.engine
    got, pending = {}, list(enumerate(ps))
    while pending or engine.has_unfinished:
        if pending:  # one new request every step: they join a batch that is already running
            i, p = pending.pop(0)
            engine.add_request(str(i), Submission(p, GREEDY))
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.token_ids
    assert [got[i] for i in range(len(ps))] == ref


def test_preemption_by_recompute_keeps_greedy_output(tiny_llama_dir, llm):
    """A pool too small for all requests preempts and recomputes; outputs stay identical."""
    ps = prompts(8, seed=11, lo=20, hi=60)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(ps, params)]
    small = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=14, block_size=8)
    preempted = []
    scheduler, preempt = small.engine.scheduler, small.engine.scheduler.preempt
    scheduler.preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    outs = small.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert preempted, "the small pool should have forced at least one preemption"
    assert small.engine.stats().preemptions == len(preempted)
    assert_pool_whole(small)


def test_stats_and_limits_are_frozen_snapshots(llm):
    """stats() and limits() are values for readers outside the engine: one taken before a
    request does not change under it, and the limits are the configured ones."""
    before = llm.engine.stats()
    llm.generate(prompts(1, seed=3, lo=40, hi=40)[0], GREEDY)
    after = llm.engine.stats()
    assert after.prefix_cache_queries > before.prefix_cache_queries and after.idle and after.kv_blocks_used == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.running = 1
    lim = llm.engine.limits()
    assert (lim.max_model_len, lim.max_num_seqs, lim.kv_blocks_total, lim.drafter, lim.tree_slots) == (256, 8, 64, None, 0)


def test_prefix_cache_reuses_a_shared_system_prompt(tiny_llama_dir):
    """The second request sharing a long prefix gets cached tokens, and the same output as without a cache."""
    shared = prompts(1, seed=12, lo=100, hi=100)[0]
    a, b = shared + [11, 12, 13], shared + [21, 22]
    with_cache = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64)
    no_cache = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, enable_prefix_cache=False)
    first = with_cache.generate(a, GREEDY)[0]
    second = with_cache.generate(b, GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 96
    assert second.token_ids == no_cache.generate(b, GREEDY)[0].token_ids
    stats = with_cache.engine.stats()          # the warm-up's scratch blocks were no lookup
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (96, 96 + 96)
    assert stats.kv_blocks_used == 0 and stats.idle


def test_stress_random_requests_cancellations_preemptions(tiny_llama_dir):
    """200 requests of random lengths, random aborts and a small pool: integrity holds after
    every step, preemptions happen, and the pool is whole at the end."""
    llm = LLM(str(tiny_llama_dir), max_model_len=192, num_kv_blocks=40, block_size=8,
              max_num_seqs=12, max_num_batched_tokens=64)
    rng = random.Random(13)
    templates = prompts(4, seed=14, lo=16, hi=40)

    def make(i):
        p = rng.choice(templates)[: rng.randint(1, 40)] + prompts(1, seed=i, lo=1, hi=30)[0]
        return p, SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 40),
                                 seed=i, ignore_eos=True)

    finished, preemptions = drive_random_requests(llm.engine, rng, 200, make, add_p=0.5, abort_p=0.1)
    assert finished == 200 and preemptions > 0
    assert_pool_whole(llm)


def test_prefix_of_a_finished_one_token_request_is_reused(tiny_llama_dir):
    """A request that finishes in its first step (max_tokens=1) still publishes its full prompt
    blocks, so the next request with the same prefix hits the cache."""
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64)
    shared = prompts(1, seed=21, lo=70, hi=70)[0]
    llm.generate(shared + [5], SamplingParams(temperature=0, max_tokens=1))
    second = llm.generate(shared + [6, 7], SamplingParams(temperature=0, max_tokens=1))[0]
    assert second.num_cached_tokens == 64


def test_a_submission_refuses_text_where_ids_belong():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Submission("hello", GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Submission(None, GREEDY)
    assert Submission(None, GREEDY, prompt="hello").prompt == "hello"
