"""The thread governor (spec/threads.py): on a simulated machine it stays on every CPU while
that is fastest, moves to fewer threads when a neighbour makes them faster, and back once the
neighbour leaves; and the engine's output does not depend on the thread count (bit for bit, the
count changing every step), with a load-time check that turns the governor off where it would."""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch

from drafters.config import SpecConfig
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig
from spec.threads import ThreadConfig, ThreadGovernor

QUIET = {1: 8.0, 2: 5.0, 3: 4.0, 4: 3.6}          # ms per step by thread count, a machine of its own
BUSY = {1: 8.5, 2: 20.0, 3: 30.0, 4: 40.0}         # one neighbour: more threads wait at barriers
SHAPE = (1, 1)          # rows, sequences


def run(gov: ThreadGovernor, cost: dict[int, float], steps: int, shape=SHAPE) -> list[int]:
    """Steps on a machine where a step on n threads takes cost[n] ms; the counts used."""
    used = []
    for _ in range(steps):
        n = gov.next_step()
        used.append(n)
        gov.observe(*shape, cost[n] / 1e3)
    return used


def test_a_quiet_machine_stays_on_every_cpu_and_probes_less_and_less():
    gov = ThreadGovernor(2)
    used = run(gov, QUIET, 3000)
    assert gov.threads == 2 and gov.switches == 0
    assert used.count(1) / len(used) < 0.02           # probe steps only, growing apart
    assert used[-1000:].count(1) <= ThreadConfig().probe_pairs


def test_a_busy_neighbour_moves_it_to_fewer_threads_and_back_once_it_leaves():
    gov = ThreadGovernor(2)
    run(gov, QUIET, 3000)                              # settled: probes are far apart
    used = run(gov, BUSY, 12)                          # the slowdown probes at once
    assert gov.threads == 1 and used[-1] == 1
    run(gov, BUSY, 3000)
    assert gov.threads == 1                            # 2 threads stay slower: no switch back
    run(gov, QUIET, ThreadConfig().max_interval + 2 * ThreadConfig().probe_pairs)
    assert gov.threads == 2 and gov.switches == 2


class Idle:
    """What the governor reads as idle CPUs: set by the test, as a neighbour comes and goes."""
    def __init__(self, value: float):
        self.value = value

    def __call__(self) -> float:
        return self.value


def neighbour_comes_and_goes(gov: ThreadGovernor, idle: Idle, busy_steps: int, after: dict) -> tuple[int, int]:
    """The counts after `busy_steps` beside a neighbour, and after three idle readings once it
    has left (the machine then costs `after`)."""
    run(gov, BUSY, busy_steps)
    during = gov.threads
    idle.value = 1.0
    run(gov, after, 3 * ThreadConfig().idle_every)
    return during, gov.threads


def test_idle_cpus_appearing_bring_it_back_at_once():
    """A neighbour that leaves frees a CPU: within a few idle readings the governor tries, and
    takes, more threads again, long before its probes (grown to max_interval apart) would."""
    gov = ThreadGovernor(2, idle=(idle := Idle(0.0)))
    assert neighbour_comes_and_goes(gov, idle, 3000, QUIET) == (1, 2)


def test_back_to_every_cpu_on_any_gain_but_away_only_by_the_margin():
    """Where all threads are only 5% faster (the server beside its own event loop), the
    governor neither leaves them for one nor stays on one once a neighbour has gone."""
    close = {1: 6.0, 2: 5.7}
    gov = ThreadGovernor(2, idle=(idle := Idle(0.0)))
    run(gov, close, 2000)
    assert gov.threads == 2 and gov.switches == 0
    assert neighbour_comes_and_goes(gov, idle, 500, close) == (1, 2)


def test_idle_cpus_it_cannot_use_do_not_probe_again_and_again():
    """Where fewer threads stay faster though CPUs sit idle (a quota), idle readings do not
    keep probing: only a change from none idle to some does."""
    gov, without = ThreadGovernor(2, idle=Idle(1.5)), ThreadGovernor(2)
    used = run(gov, BUSY, 5000)
    assert gov.threads == 1 and used == run(without, BUSY, 5000)      # the same probes as without


def test_it_descends_one_count_at_a_time_to_the_fastest():
    """On 4 CPUs with a neighbour, 1 thread is fastest: 4 -> 3 -> 2 -> 1, never below."""
    gov = ThreadGovernor(4)
    run(gov, BUSY, 400)
    assert gov.threads == 1
    gov2 = ThreadGovernor(4)
    run(gov2, {1: 8.0, 2: 5.0, 3: 6.5, 4: 7.5}, 600)   # a neighbour on one core of four
    assert gov2.threads == 2


def test_pairs_of_different_shapes_do_not_count():
    """A pair whose two steps differ in rows or sequences by a power of two or more says nothing
    about the threads: with every step's shape new, no probe ever decides."""
    gov = ThreadGovernor(2, ThreadConfig(first_interval=1))
    for i in range(200):
        n = gov.next_step()
        gov.observe(1 << (i % 12), 1, BUSY[n] / 1e3)      # every step twice the rows of the last
    assert gov.switches == 0


def test_counts_within_a_power_of_two_make_a_pair():
    """A churning batch (5, 6, 7 rows; 3 requests, then 2) still gets compared."""
    gov = ThreadGovernor(2)
    for i in range(100):
        n = gov.next_step()
        gov.observe(4 + i % 4, 2 + i % 2, BUSY[n] / 1e3)
    assert gov.threads == 1


def test_off_or_one_cpu_never_changes_the_count():
    assert set(run(ThreadGovernor(2, ThreadConfig(adaptive=False)), BUSY, 500)) == {2}
    assert set(run(ThreadGovernor(1), BUSY, 500)) == {1}


def test_beside_a_neighbour_probes_cost_few_steps_on_the_extra_thread():
    """Where a step on 2 threads costs several on 1: the slowdown's probe decides on two clear
    pairs, the slow step itself the first half of the first, and with no CPU idle no probe tries
    2 threads again until max_interval (without an idle meter they come every few hundred)."""
    crowded = ThreadGovernor(2, idle=Idle(0.0))
    run(crowded, QUIET, 3000)
    used = run(crowded, BUSY, 3000)
    assert crowded.threads == 1 and used[:4] == [2, 1, 2, 1]      # slow step, then two pairs
    assert used[4:].count(2) <= 2 * (3000 // ThreadConfig().max_interval + 1)
    blind = ThreadGovernor(2)
    run(blind, QUIET, 3000)
    assert run(blind, BUSY, 3000)[4:].count(2) > used[4:].count(2)


@pytest.mark.parametrize("ratios, pairs", [([0.5, 0.6, 0.7, 1.2], 3), ([0.95, 1.0, 0.7, 0.6], 4),
                                           ([0.8, 0.97, 0.85, 0.99], 4), ([1.1, 0.5, 1.3, 0.2], 4),
                                           ([1.4, 1.0, 0.95, 0.2], 3)])
def test_a_probe_stops_early_only_when_its_outcome_is_known(ratios, pairs):
    """The median rule over probe_pairs pairs (1 thread wins below `margin`), decided as soon as
    the pairs left could not change it: the same answer as after all of them."""
    gov = ThreadGovernor(2, ThreadConfig(clear=1e9))        # only the majority shortcut
    run(gov, QUIET, ThreadConfig().probe_pairs)             # the first probe starts now
    left = iter(ratios)
    while gov.probing:
        n = gov.next_step()
        gov.observe(*SHAPE, (QUIET[2] * (next(left) if n == 1 else 1.0)) / 1e3)
    assert len(list(left)) == len(ratios) - pairs
    assert gov.threads == (1 if statistics.median(ratios) < ThreadConfig().margin else 2)


def test_it_starts_on_the_cpus_left_free_and_takes_more_once_they_idle():
    gov = ThreadGovernor(2, idle=(idle := Idle(0.0)), start=1)
    assert run(gov, BUSY, 200) == [1] * 200               # no CPU idle: no probe up yet
    assert neighbour_comes_and_goes(gov, idle, 10, QUIET) == (1, 2)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("idle_then, expected", [(0.9, 1), (1.7, 2)])
def test_after_a_gap_it_runs_on_the_cpus_left_idle(idle_then, expected):
    """A neighbour that arrived while the engine waited: the first step after the gap already
    runs on the CPUs that sat idle meanwhile, before any slow step (none arrived: unchanged).
    A pause shorter than gap_s reads nothing."""
    gov = ThreadGovernor(2, idle=Idle(0.0), gap_idle=(gap := Idle(2.0)), clock=(clock := Clock()))
    for _ in range(100):
        clock.now += 0.005
        gov.observe(*SHAPE, QUIET[gov.next_step()] / 1e3)
    gap.value = idle_then
    clock.now += ThreadConfig().gap_s / 2
    assert gov.next_step() == 2
    gov.observe(*SHAPE, QUIET[2] / 1e3)
    clock.now += 2 * ThreadConfig().gap_s
    assert gov.next_step() == expected and gov.threads == expected


@pytest.mark.parametrize("bad", [dict(probe_pairs=0), dict(margin=0), dict(margin=1.5),
                                 dict(first_interval=0), dict(first_interval=64, max_interval=32),
                                 dict(slowdown=1.0), dict(idle_every=0), dict(idle_cpus=0), dict(clear=1.0),
                                 dict(gap_s=0)])
def test_config_is_checked(bad):
    with pytest.raises(ValueError, match="ThreadConfig"):
        ThreadConfig(**bad)


class EveryStep:
    """A governor that changes the thread count on every step: 1, 2, 1, 2, ..."""
    active, switches = True, 0

    def __init__(self):
        self.threads = 1

    def next_step(self) -> int:
        self.threads = 3 - self.threads
        return self.threads

    def observe(self, rows, seqs, seconds) -> None:
        pass


PROMPTS = ["Name three rivers and say where each one flows. " * 3, "Why is the sky blue?",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_output_is_the_same_whatever_the_thread_count(drafter, monkeypatch):
    """SmolLM2 (int4 kernels, bf16 prompt rows): with the count changing every step, every
    forward's logits equal those on 2 threads throughout, bit for bit, and so do the T=0 and
    seeded T=0.8 outputs, plain and speculative. Whole trees: the adaptive controller's cuts
    follow timings, and the two runs must verify the same rows."""
    llm = LLM(drafter=drafter, num_threads=2, thread_tuning=ThreadConfig(adaptive=False),
              adaptive=AdaptiveConfig(enabled=False),
              speculation=SpecConfig(num_speculative_tokens=3) if drafter else None)
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11)]
    target, logits = llm.engine.target, []
    forward = target.forward

    def recorded(batch):
        out = forward(batch)
        logits.append(out.logits.clone())
        return out
    monkeypatch.setattr(target, "forward", recorded)

    def outputs():
        llm.engine.reset_prefix_cache()
        logits.clear()
        return [o.token_ids for p in params for o in llm.generate(PROMPTS, p)], list(logits)
    fixed, fixed_logits = outputs()
    llm.engine.threads = EveryStep()
    changing, changing_logits = outputs()
    torch.set_num_threads(2)
    assert changing == fixed
    assert len(changing_logits) == len(fixed_logits)
    assert all(torch.equal(a, b) for a, b in zip(fixed_logits, changing_logits))


def test_a_forward_whose_bits_follow_the_thread_count_turns_the_governor_off(tiny_llama_dir, monkeypatch, caplog,
                                                                            tmp_path):
    """The load-time check: were a kernel to sum in another order on fewer threads, the engine
    keeps its thread count fixed (and says so) rather than change a row's bits mid-request. Each
    load checks afresh (a cache of its own): a forward patched to differ is not the machine's."""
    from spec import curve_cache
    from verifier.target import TargetModel
    forward, caches = TargetModel.forward, iter([tmp_path / "a", tmp_path / "b"])
    monkeypatch.setattr(curve_cache, "cache_root", lambda: next(caches))

    def thread_dependent(self, batch):
        out = forward(self, batch)
        return replace(out, logits=out.logits + 1e-6) if torch.get_num_threads() == 1 else out
    monkeypatch.setattr(TargetModel, "forward", thread_dependent)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, num_threads=2)
    assert not llm.engine.threads.active and "depend on the thread count" in caplog.text
    monkeypatch.setattr(TargetModel, "forward", forward)
    assert LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, num_threads=2).engine.threads.active


def test_the_thread_check_is_made_once_per_machine_and_target_shape(tiny_llama_dir, monkeypatch, tmp_path,
                                                                   neighbours):
    """A second load of the same target reads the first one's answer instead of running the
    check's forwards again; the governor is on after both (the machine taken as quiet: a busy one
    keeps no answer)."""
    from spec import curve_cache, preparation
    checks, check = [], preparation.same_on_every_count
    monkeypatch.setattr(curve_cache, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(preparation, "same_on_every_count",
                        lambda forward, counts: checks.append(counts) or check(forward, counts))
    for _ in range(2):
        assert LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, num_threads=2).engine.threads.active
    assert checks == [[1, 2]]
