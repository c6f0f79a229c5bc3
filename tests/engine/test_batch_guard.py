"""The batch guard (spec/batch_guard.py): per batch size, speculation runs while its measured
windows cost less per token than plain ones; the losing mode is checked again ever more
rarely; the engine's output stays the target's whatever the guard decides. The guard's
inputs are stated here (step times fed to it), never this machine's timings."""
from __future__ import annotations

import pytest

from drafters.config import SpecConfig
from spec.adaptive import AdaptiveConfig
from spec.batch_guard import PLAIN, SPECULATE, BatchGuard, GuardConfig
from spec.step_cost import CostCurve
from verifier.sampling.sampling_params import SamplingParams


def run(guard: BatchGuard, decoding: int, ms_per_token: dict[str, float], steps: int) -> list[str]:
    """`steps` decode steps of `decoding` requests, each emitting `decoding` tokens at the
    stated cost of the mode the guard chose; the modes, in order."""
    modes = []
    for _ in range(steps):
        spec = guard.speculates(decoding)
        mode = SPECULATE if spec else PLAIN
        modes.append(mode)
        guard.observe(decoding, spec, decoding, decoding * ms_per_token[mode] / 1e3)
    return modes


def test_plain_takes_over_where_speculation_costs_more_and_is_checked_ever_more_rarely():
    g = BatchGuard(GuardConfig(window=2, every=2, max_every=8))
    modes = run(g, 4, {SPECULATE: 2.2, PLAIN: 2.0}, 80)
    # two speculating windows, a plain one; plain leads from then, speculation checked after 2,
    # then 4, then 8 plain windows (a gap counts the check's own window too)
    assert modes[:10] == [SPECULATE] * 4 + [PLAIN] * 6 and modes[10:12] == [SPECULATE] * 2
    checks = [i for i in range(10, 80, 2) if modes[i] == SPECULATE]
    gaps = [(b - a) // 2 for a, b in zip(checks, checks[1:])]
    assert gaps[:2] == [5, 9] and set(gaps[2:]) == {9}
    assert g.sizes[4].leader == PLAIN


def test_speculation_that_pays_keeps_speculating_with_rare_plain_windows():
    g = BatchGuard(GuardConfig(window=4, every=2, max_every=16))
    modes = run(g, 2, {SPECULATE: 5.0, PLAIN: 6.0}, 400)
    assert g.sizes[2].leader == SPECULATE
    # plain windows 3, 8, 17, 34, 51, 68 and 85 of 100: after 2 windows, then 4, 8 and 16
    plain_windows = [i // 4 for i in range(0, 400, 4) if modes[i] == PLAIN]
    assert plain_windows == [2, 7, 16, 33, 50, 67, 84] and modes.count(PLAIN) == 7 * 4


def test_a_leader_that_turns_worse_is_checked_at_once_and_replaced():
    g = BatchGuard(GuardConfig(window=1, every=4, max_every=64, memory=0.0))
    run(g, 2, {SPECULATE: 1.0, PLAIN: 2.0}, 40)
    assert g.sizes[2].leader == SPECULATE
    modes = run(g, 2, {SPECULATE: 3.0, PLAIN: 2.0}, 3)
    assert modes == [SPECULATE, PLAIN, PLAIN] and g.sizes[2].leader == PLAIN


def test_sizes_are_powers_of_two_and_each_has_its_own_windows():
    assert [BatchGuard.bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 16, 31)] == [1, 1, 2, 2, 4, 4, 8, 16, 16]
    g = BatchGuard(GuardConfig(window=1, every=1, max_every=4, min_batch=1))
    run(g, 16, {SPECULATE: 3.0, PLAIN: 1.0}, 10)
    run(g, 1, {SPECULATE: 1.0, PLAIN: 3.0}, 10)
    assert g.sizes[16].leader == PLAIN and g.sizes[1].leader == SPECULATE


def test_a_lone_request_is_left_to_the_controller():
    g = BatchGuard(GuardConfig(window=1, every=1))
    assert run(g, 1, {SPECULATE: 9.0, PLAIN: 1.0}, 20) == [SPECULATE] * 20 and g.sizes == {}
    assert PLAIN in run(g, 2, {SPECULATE: 9.0, PLAIN: 1.0}, 20)


def test_a_step_read_in_another_mode_or_without_tokens_is_not_counted():
    g = BatchGuard(GuardConfig(window=1))
    g.observe(4, False, 4, 0.01)           # the window is a speculating one
    g.observe(4, True, 0, 0.01)
    assert g.sizes[4].rate == {}
    g.observe(4, True, 4, 0.008)
    assert g.sizes[4].rate == {SPECULATE: pytest.approx(2.0)}


def test_disabled_always_speculates_and_config_is_checked():
    g = BatchGuard(GuardConfig(enabled=False, window=1))
    assert run(g, 4, {SPECULATE: 9.0, PLAIN: 1.0}, 20) == [SPECULATE] * 20
    for bad in ({"window": 0}, {"every": 0}, {"every": 8, "max_every": 4}, {"memory": 1.0}, {"min_batch": 0}):
        with pytest.raises(ValueError):
            GuardConfig(**bad)
    with pytest.raises(ValueError):
        AdaptiveConfig(guard={"window": 2})


def test_engine_output_stays_the_targets_while_the_guard_switches_every_step(tiny_llama_dir):
    """A guard that turns speculation on and off at every step (windows of one step, the
    other mode checked after each) leaves greedy outputs equal to plain decoding's and the
    pool whole; it is on only where the controller's costs are measured."""
    from spec import LLM
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [3, 4, 3, 4, 3]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(max_model_len=256, num_kv_blocks=64)
    plain = [o.token_ids for o in LLM(str(tiny_llama_dir), **kw).generate(prompts, greedy)]
    guard = GuardConfig(window=1, every=1, max_every=1)
    llm = LLM(str(tiny_llama_dir), **kw, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=4), adaptive=AdaptiveConfig(guard=guard))
    engine, modes = llm.engine, []
    speculates = engine.guard.speculates
    engine.guard.speculates = lambda n: modes.append(speculates(n)) or modes[-1]
    assert engine.guard.config.enabled
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    assert True in modes and False in modes
    assert engine.blocks.num_used_blocks == 0
    stated = AdaptiveConfig(guard=guard, cost_curve=CostCurve((1, 2), (1.0, 2.0)))
    assert not LLM(str(tiny_llama_dir), **kw, drafter="ngram", adaptive=stated).engine.guard.config.enabled


def test_steps_where_no_request_may_draft_teach_the_guard_nothing(tiny_llama_dir):
    """Requests sent with speculation off decode plainly whatever the guard says: their steps
    are not counted as either mode's."""
    from spec import LLM
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              adaptive=AdaptiveConfig(guard=GuardConfig(window=1)))
    llm.generate([[5, 6, 7, 5, 6, 7], [9, 8, 9, 8]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 speculate=False)
    assert llm.engine.guard.config.enabled
    assert all(s.steps == 0 and not s.rate for s in llm.engine.guard.sizes.values())


def test_leaders_report_each_measured_size():
    g = BatchGuard(GuardConfig(window=1, every=1))
    run(g, 4, {SPECULATE: 3.0, PLAIN: 1.0}, 6)
    run(g, 2, {SPECULATE: 1.0, PLAIN: 3.0}, 6)
    assert g.leaders() == ((2, True), (4, False))
