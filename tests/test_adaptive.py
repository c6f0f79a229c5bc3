"""The adaptive speculation controller: off above max_batch, and otherwise on only while the
speculative rate at the current batch size beats the plain rate at that same batch size;
trees shrink as the batch grows."""
import pytest

from drafters.config import SpecConfig
from spec.adaptive import AdaptiveConfig, AdaptiveController
from verifier.sampling_params import SamplingParams


def feed(ctl: AdaptiveController, batch: int, spec: float, plain: float) -> None:
    """One decode step of each kind at `batch` requests, at these tokens/s per request."""
    ctl.observe(True, batch, spec, 1.0)
    ctl.observe(False, batch, plain, 1.0)


def test_off_above_max_batch_and_when_disabled_always_on():
    ctl = AdaptiveController(AdaptiveConfig(max_batch=4))
    assert not ctl.enabled(5) and not ctl.state
    always = AdaptiveController(AdaptiveConfig(enabled=False, max_batch=4))
    feed(always, 2, spec=1.0, plain=9.0)
    assert always.enabled(2) and always.enabled(16)


def test_measures_speculation_then_plain_at_each_batch_size():
    ctl = AdaptiveController(AdaptiveConfig(min_steps=1))
    assert ctl.enabled(2)                  # nothing measured: speculate first
    ctl.observe(True, 2, 3.0, 1.0)
    assert not ctl.enabled(2)              # then one plain step to compare against
    ctl.observe(False, 2, 2.0, 1.0)
    assert ctl.enabled(2)                  # 3 > 2 tokens/s per request: keep speculating
    assert ctl.enabled(3)                  # a batch size not seen yet starts over


def test_rates_are_compared_at_the_same_batch_size():
    # Speculation pays alone (30 vs 20 tokens/s) and loses at 8 requests (5 vs 8). Mixing
    # batch sizes would compare batch-1 speculation (30) with batch-8 plain decoding (8).
    ctl = AdaptiveController(AdaptiveConfig(max_batch=8, min_steps=1))
    feed(ctl, 1, spec=30.0, plain=20.0)
    feed(ctl, 8, spec=5.0, plain=8.0)
    assert ctl.enabled(1)
    assert not ctl.enabled(8)


def test_probes_while_off_and_turns_back_on_when_it_pays_again():
    ctl = AdaptiveController(AdaptiveConfig(probe_every=4, smoothing=1.0, wide_margin=10.0, min_steps=1))
    feed(ctl, 2, spec=1.0, plain=2.0)
    decisions = [ctl.enabled(2) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2
    ctl.observe(True, 2, 5.0, 1.0)         # a probe finds a repetitive passage
    assert ctl.enabled(2)


def test_probes_plain_decoding_while_on_so_a_stale_plain_rate_is_replaced():
    ctl = AdaptiveController(AdaptiveConfig(max_batch=8, probe_every=4, smoothing=1.0, wide_margin=10.0, min_steps=1))
    feed(ctl, 8, spec=10.0, plain=8.0)     # early on, speculation looked faster
    decisions = [ctl.enabled(8) for _ in range(8)]
    assert decisions == [True, True, True, False] * 2
    ctl.observe(False, 8, 12.0, 1.0)       # a plain probe: plain decoding is faster now
    assert not ctl.enabled(8)


def test_a_wide_lead_makes_probes_rarer():
    ctl = AdaptiveController(AdaptiveConfig(max_batch=8, probe_every=4, smoothing=1.0, wide_margin=1.25, min_steps=1))
    feed(ctl, 1, spec=15.0, plain=10.0)    # 1.5x: probe plain decoding one step in 16
    assert [ctl.enabled(1) for _ in range(16)] == [True] * 15 + [False]
    feed(ctl, 1, spec=11.0, plain=10.0)    # 1.1x: one step in 4
    assert [ctl.enabled(1) for _ in range(4)] == [True, True, True, False]
    feed(ctl, 2, spec=5.0, plain=10.0)     # losing by 2x: probe speculation one step in 16
    assert [ctl.enabled(2) for _ in range(16)] == [False] * 15 + [True]


def test_early_averages_are_plain_means_so_one_unlucky_step_does_not_stick():
    ctl = AdaptiveController(AdaptiveConfig(probe_every=4, smoothing=0.05, wide_margin=1.25, min_steps=1))
    feed(ctl, 1, spec=10.0, plain=20.0)    # the first draft was rejected
    # Two steps are too few to trust a 2x lead: the probe comes at the normal pace.
    assert [ctl.enabled(1) for _ in range(4)] == [False, False, False, True]
    ctl.observe(True, 1, 40.0, 1.0)        # the probe: the mean of 10 and 40 beats 20
    assert ctl.enabled(1)


def test_measures_min_steps_of_each_mode_before_comparing():
    ctl = AdaptiveController(AdaptiveConfig(min_steps=3))
    decisions = []
    for _ in range(7):
        on = ctl.enabled(1)
        decisions.append(on)
        ctl.observe(on, 1, 1.0 if on else 2.0, 1.0)   # speculation loses from its first step
    assert decisions == [True, True, True, False, False, False, False]


def test_draft_budget_is_shared_by_the_batch():
    ctl = AdaptiveController(AdaptiveConfig(step_draft_tokens=6))
    assert [ctl.draft_budget(b) for b in (0, 1, 2, 3, 4, 7)] == [6, 6, 3, 2, 1, 1]
    assert AdaptiveController(AdaptiveConfig(enabled=False)).draft_budget(4) is None


def test_engine_shrinks_trees_with_the_batch_but_not_a_seeded_sampled_request(tiny_llama_dir):
    from spec import LLM
    llm = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=4, drafter="ngram",
              speculation=SpecConfig(num_speculative_tokens=4, budget=4),
              adaptive=AdaptiveConfig(max_batch=8, step_draft_tokens=4, margin=1e-9))
    engine, seen = llm.engine, []
    propose = engine.drafter.propose

    def spy(reqs):
        seen.append([(len(engine.scheduler.running), r.params.seed, r.max_nodes, r.max_depth) for r in reqs])
        return propose(reqs)
    engine.drafter.propose = spy
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [3, 4, 3, 4, 3], [11, 12, 11, 12]],
                 [greedy, greedy, greedy, seeded])
    views = [v for step in seen for v in step]
    assert any(running == 4 for running, *_ in views)
    for running, seed, nodes, depth in views:
        cap = 4 if seed is not None else 4 // running        # the seeded request keeps its tree
        assert nodes == min(4, cap) and depth <= nodes, (running, seed, nodes, depth)
    assert engine.blocks.num_used_blocks == 0


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_batch"):
        AdaptiveConfig(max_batch=0)
    with pytest.raises(ValueError, match="step_draft_tokens"):
        AdaptiveConfig(step_draft_tokens=0)
    with pytest.raises(ValueError, match="wide_margin"):
        AdaptiveConfig(wide_margin=0.5)
    with pytest.raises(ValueError, match="min_steps"):
        AdaptiveConfig(min_steps=0)
