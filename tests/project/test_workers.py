"""`make test`'s workers (tests/workers.py): how many, and the heavy files first, on one of them."""
from __future__ import annotations

from types import SimpleNamespace

from conftest import ROOT
from workers import HEAVY_MODULES, WORKER_MEMORY, HeavyFirst, worker_count


def test_one_worker_per_cpu_as_the_free_memory_allows():
    assert worker_count(2, 24 << 30) == 2
    assert worker_count(16, 4 * WORKER_MEMORY) == 4
    assert worker_count(2, WORKER_MEMORY - 1) == 1          # never none
    assert worker_count(2, None) == 2


def test_every_heavy_module_named_is_a_test_file():
    assert all((ROOT / path).is_file() and path.startswith("tests/") for path in HEAVY_MODULES)


class FakeWorker:
    """What the scheduler calls on an xdist worker: it records the tests it was sent."""

    def __init__(self, name: str):
        self.sent, self.shutting_down, self.gateway = [], False, SimpleNamespace(id=name)

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def test_the_heavy_files_go_first_and_together_to_one_worker(pytestconfig, monkeypatch):
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])         # what `-n 2` sets
    heavy = sorted(HEAVY_MODULES)[:2]
    collection = [f"tests/engine/test_{name}.py::test_{i}" for name in ("a", "b", "c") for i in range(4)]
    collection[2:2] = [f"{heavy[0]}::test_x", f"{heavy[0]}::test_y"]
    collection.append(f"{heavy[1]}::test_z")
    scheduler, workers = HeavyFirst(pytestconfig), [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    first, second = ([collection[i] for i in w.sent] for w in workers)
    assert first[:3] == [f"{heavy[0]}::test_x", f"{heavy[0]}::test_y", f"{heavy[1]}::test_z"]
    assert not any(nodeid.split("::")[0] in HEAVY_MODULES for nodeid in first[3:] + second)
    assert {nodeid.split("::")[0] for nodeid in second} <= {"tests/engine/test_a.py", "tests/engine/test_b.py",
                                                            "tests/engine/test_c.py"}
