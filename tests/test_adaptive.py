"""The adaptive speculation controller: off above max_batch, and otherwise on only while the
speculative rate at the current batch size beats the plain rate at that same batch size."""
import pytest

from spec.adaptive import AdaptiveConfig, AdaptiveController


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
    ctl = AdaptiveController()
    assert ctl.enabled(2)                  # nothing measured: speculate first
    ctl.observe(True, 2, 3.0, 1.0)
    assert not ctl.enabled(2)              # then one plain step to compare against
    ctl.observe(False, 2, 2.0, 1.0)
    assert ctl.enabled(2)                  # 3 > 2 tokens/s per request: keep speculating
    assert ctl.enabled(3)                  # a batch size not seen yet starts over


def test_rates_are_compared_at_the_same_batch_size():
    # Speculation pays alone (30 vs 20 tokens/s) and loses at 8 requests (5 vs 8). Mixing
    # batch sizes would compare batch-1 speculation (30) with batch-8 plain decoding (8).
    ctl = AdaptiveController(AdaptiveConfig(max_batch=8))
    feed(ctl, 1, spec=30.0, plain=20.0)
    feed(ctl, 8, spec=5.0, plain=8.0)
    assert ctl.enabled(1)
    assert not ctl.enabled(8)


def test_probes_while_off_and_turns_back_on_when_it_pays_again():
    ctl = AdaptiveController(AdaptiveConfig(probe_every=4, smoothing=1.0))
    feed(ctl, 2, spec=1.0, plain=2.0)
    decisions = [ctl.enabled(2) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2
    ctl.observe(True, 2, 5.0, 1.0)         # a probe finds a repetitive passage
    assert ctl.enabled(2)


def test_probes_plain_decoding_while_on_so_a_stale_plain_rate_is_replaced():
    ctl = AdaptiveController(AdaptiveConfig(max_batch=8, probe_every=4, smoothing=1.0))
    feed(ctl, 8, spec=10.0, plain=8.0)     # early on, speculation looked faster
    decisions = [ctl.enabled(8) for _ in range(8)]
    assert decisions == [True, True, True, False] * 2
    ctl.observe(False, 8, 12.0, 1.0)       # a plain probe: plain decoding is faster now
    assert not ctl.enabled(8)


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_batch"):
        AdaptiveConfig(max_batch=0)
