"""`make test`'s workers (tests/workers.py): how many, and a heavy module alone."""
from __future__ import annotations

import fcntl
import tempfile
import threading
import time

from workers import WORKER_MEMORY, module_turn, worker_count


def test_one_worker_per_cpu_as_the_free_memory_allows():
    assert worker_count(2, 24 << 30) == 2
    assert worker_count(16, 4 * WORKER_MEMORY) == 4
    assert worker_count(2, WORKER_MEMORY - 1) == 1          # never none
    assert worker_count(2, None) == 2


def _turnstile_taken(folder, run_id) -> bool:
    with open(folder / f"tercel-tests-{run_id}.turnstile", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_a_heavy_module_waits_for_the_light_one_running_and_keeps_newcomers_out(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    order, first_in, first_may_leave = [], threading.Event(), threading.Event()

    def module(name, alone, hold=None):
        with module_turn("run", alone):
            order.append(f"{name} in")
            if hold:
                first_in.set()
                first_may_leave.wait()
            order.append(f"{name} out")

    light = threading.Thread(target=module, args=("light", False, True))
    heavy = threading.Thread(target=module, args=("heavy", True))
    late = threading.Thread(target=module, args=("late", False))
    light.start()
    first_in.wait()
    heavy.start()
    for _ in range(1000):                             # the heavy module waits, holding the turnstile
        if _turnstile_taken(tmp_path, "run"):
            break
        time.sleep(0.01)
    late.start()
    first_may_leave.set()
    for t in (light, heavy, late):
        t.join()
    assert order == ["light in", "light out", "heavy in", "heavy out", "late in", "late out"]
