"""When attention runs on all threads is measured at load (verifier/quantized/attention_tuning.py):
the rule that turns timings into a threshold, and the cache that keeps it per machine."""
from __future__ import annotations

import json

import torch

from verifier.cpu import cpu_ops
from verifier.quantized import attention_tuning
from verifier.quantized.attention_tuning import NEVER, choose, tune

_NO_ROPE = torch.zeros(1, 1)


def test_the_threshold_is_the_smallest_work_won_at_every_larger_size():
    """All threads lose at 64 keys, win at 128 and above: the threshold is 128 keys' work; a
    loss above a win moves it up; a loss at the largest size means never."""
    serial = {(1, 64): 10.0, (1, 128): 20.0, (1, 256): 40.0}
    assert choose(serial, {(1, 64): 11.0, (1, 128): 15.0, (1, 256): 25.0}, heads=9) == 128 * 9
    assert choose(serial, {(1, 64): 9.0, (1, 128): 21.0, (1, 256): 25.0}, heads=9) == 256 * 9
    assert choose(serial, {(1, 64): 9.0, (1, 128): 15.0, (1, 256): 41.0}, heads=9) == NEVER
    # a win inside timing noise (19.5 against 20: under 5%) is not a win
    assert choose(serial, {(1, 64): 9.0, (1, 128): 19.5, (1, 256): 25.0}, heads=9) == 256 * 9


def test_tune_measures_once_per_machine_and_sets_the_heads(tmp_path, monkeypatch, neighbours, quick_timings):
    """The first load measures and caches; the next reads the cache (no timing); both set
    Heads.parallel_from, which the kernels read at each call."""
    hd = cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE)
    first = tune(hd, tmp_path)
    assert hd.parallel_from == first.parallel_from
    assert set(first.serial) <= {(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS}
    saved = json.loads(next(tmp_path.glob("attention-*.json")).read_text())
    assert saved["timings"]["parallel_from"] == first.parallel_from
    monkeypatch.setattr(attention_tuning, "measure", lambda hd: (_ for _ in ()).throw(AssertionError("re-timed")))
    hd2 = cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE)
    assert tune(hd2, tmp_path).parallel_from == first.parallel_from == hd2.parallel_from


def test_timings_taken_beside_a_busy_neighbour_give_way_to_the_default_threshold(tmp_path, monkeypatch, neighbours):
    """Beside a busy neighbour one thread wins every size (the other thread waits to be
    scheduled): such timings are not cached and the heads take the default threshold, not
    theirs, which would keep attention on one thread for good."""
    keys = [(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS]
    crowded = attention_tuning.AttentionTimings({c: 10.0 for c in keys}, {c: 900.0 for c in keys}, NEVER)
    monkeypatch.setattr(attention_tuning, "measure", lambda hd: crowded)
    neighbours(0.9)
    hd = cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE)
    assert tune(hd, tmp_path, threads=2).parallel_from == hd.parallel_from == cpu_ops.PARALLEL_FROM
    assert not list(tmp_path.glob("attention-*.json"))
    neighbours(0.0)
    assert tune(hd, tmp_path, threads=2).parallel_from == hd.parallel_from == NEVER
    assert len(list(tmp_path.glob("attention-*.json"))) == 1


def test_cold_calls_flush_where_the_build_can_and_read_the_evictor_elsewhere(monkeypatch):
    """On x86-64 the KV set is flushed line by line (its values kept); a build without a flush
    instruction times the same cells with the KV pushed out by reading a cache-sized buffer."""
    import platform
    t = torch.randn(4096)
    kept = t.clone()
    cpu_ops.flush(t)
    assert torch.equal(t, kept) and cpu_ops.can_flush() == (platform.machine() == "x86_64")
    assert (attention_tuning._evictor() is None) == cpu_ops.can_flush()
    monkeypatch.setattr(cpu_ops, "can_flush", lambda: False)
    assert attention_tuning._evictor().numel() * 4 >= 32 << 20
    hd = cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE)
    timed = attention_tuning.measure(hd, rounds=1, calls=1)
    assert timed.serial and set(timed.serial) <= {(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS}
    assert all(v > 0 for v in [*timed.serial.values(), *timed.parallel.values()])


def test_sizes_are_timed_from_the_most_work_down_to_the_first_all_threads_lose(monkeypatch):
    """All threads win from 2 x 64 rows x keys of work (by timings made up per size): every size
    from the most work down to the first loss is timed, none below it, and the threshold is the
    one `choose` gives on every size."""
    every = [(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS]
    serial = {c: float(c[0] * c[1]) for c in every}
    parallel = {c: serial[c] * (0.5 if c[0] * c[1] >= 128 else 1.2) for c in every}
    timed = []

    def cold_call(hd, case, stand_in, evict):
        plan, q = case[0], case[1]
        cell = (q.shape[0], plan.longest)
        timed.append(cell)
        return parallel[cell] if hd.parallel_from == 0 else serial[cell]
    monkeypatch.setattr(attention_tuning, "_cold_call", cold_call)
    hd = cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE)
    got = attention_tuning.measure(hd, rounds=1, calls=1)
    down = sorted(every, key=lambda c: (c[0] * c[1], c), reverse=True)
    first_loss = next(i for i, c in enumerate(down) if c[0] * c[1] < 128)
    assert got.parallel_from == choose(serial, parallel, heads=4) == 128 * 4
    assert list(dict.fromkeys(timed)) == down[:first_loss + 1] == list(got.serial)


def test_a_clear_cut_size_takes_one_round_and_a_close_one_all(monkeypatch):
    """All threads take half the time at the most work (a clear win: one round), 0.9 of it below
    (under MARGIN, not clear-cut: every round), and lose at the least work (where it stops)."""
    every = [(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS]
    down = sorted(every, key=lambda c: (c[0] * c[1], c), reverse=True)
    share = {c: 0.5 if i == 0 else 0.9 if i < len(down) - 1 else 1.1 for i, c in enumerate(down)}
    calls = []

    def cold_call(hd, case, stand_in, evict):
        cell = (case[1].shape[0], case[0].longest)
        calls.append(cell)
        return 100.0 * (share[cell] if hd.parallel_from == 0 else 1.0)
    monkeypatch.setattr(attention_tuning, "_cold_call", cold_call)
    got = attention_tuning.measure(cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE), rounds=3, calls=1)
    per_size = {c: calls.count(c) for c in down}
    assert per_size[down[0]] == 2 and per_size[down[1]] == 6 == per_size[down[-1]]   # a call per mode and round
    assert got.parallel_from == down[-2][0] * down[-2][1] * 4


def test_a_stall_in_one_round_does_not_end_the_descent(monkeypatch):
    """All threads win everywhere, but the most work's first round of all-thread calls ran in a
    stall of the host (ten times slower): a loss in that round alone. Its median over the
    rounds is a win, and every size is timed."""
    every = [(r, k) for r in attention_tuning.ROWS for k in attention_tuning.KEYS]
    down = sorted(every, key=lambda c: (c[0] * c[1], c), reverse=True)
    calls = []

    def cold_call(hd, case, stand_in, evict):
        cell = (case[1].shape[0], case[0].longest)
        calls.append((cell, hd.parallel_from == 0))
        stalled = cell == down[0] and hd.parallel_from == 0 and calls.count((cell, True)) == 1
        return 100.0 * ((10.0 if stalled else 0.5) if hd.parallel_from == 0 else 1.0)
    monkeypatch.setattr(attention_tuning, "_cold_call", cold_call)
    got = attention_tuning.measure(cpu_ops.heads(4, 2, 16, 0.25, _NO_ROPE, _NO_ROPE), rounds=3, calls=1)
    assert list(got.serial) == down and got.parallel_from == down[-1][0] * down[-1][1] * 4
