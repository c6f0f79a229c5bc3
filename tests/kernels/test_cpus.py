"""The CPUs a process may use (verifier/cpu/cpus.py): its affinity mask and its cgroup's CPU quota,
read from fake cgroup trees (v1 and v2, nested, inside a container) and, where this machine lets
the test make a cgroup, from a real one; the engine's default thread count follows both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.contention import make_cgroup
from verifier import memory
from verifier.cpu.cpus import CpuBudget, ProcFiles, cgroup_quota, cpu_budget
from verifier.memory import available_bytes, cgroup_headroom

ROOT = Path(__file__).resolve().parents[2]
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNTS = ("32 31 0:29 /kubepods/pod1 /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "33 31 0:30 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n")


def fake_tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> ProcFiles:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return ProcFiles(tmp_path / "cgroup", tmp_path / "mountinfo", tmp_path)


def test_v2_quota_is_the_smallest_on_the_path_to_the_root(tmp_path):
    """A pod's limit sits on a parent cgroup: 1.5 CPUs there hold the leaf, whose own is max."""
    files = fake_tree(tmp_path, "0::/pod/app\n", V2_MOUNT, {
        "sys/fs/cgroup/cpu.max": "max 100000\n",
        "sys/fs/cgroup/pod/cpu.max": "150000 100000\n",
        "sys/fs/cgroup/pod/app/cpu.max": "max 100000\n"})
    assert cgroup_quota(files) == 1.5


def test_v2_without_a_quota(tmp_path):
    files = fake_tree(tmp_path, "0::/app\n", V2_MOUNT, {"sys/fs/cgroup/app/cpu.max": "max 100000\n"})
    assert cgroup_quota(files) is None


def test_v1_in_a_container_strips_the_mount_root(tmp_path):
    """Inside a container the cpu,cpuacct mount's root is the pod's own cgroup: the path in
    /proc/self/cgroup is relative to it, and -1 means no quota."""
    files = fake_tree(tmp_path, "5:cpuset:/kubepods/pod1/c1\n4:cpu,cpuacct:/kubepods/pod1/c1\n", V1_MOUNTS, {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/c1/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/c1/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(files) == 2.5


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_quota(ProcFiles(tmp_path / "none", tmp_path / "none", tmp_path)) is None


def test_a_containers_memory_limit_less_its_working_set_is_what_it_has(tmp_path, monkeypatch):
    """The pod's 4 GB limit on a parent cgroup, 3 GB charged to it of which 1 GB is page cache
    the kernel reclaims before it kills (a GGUF read once): 2 GB left, though the host's
    MemAvailable says more. An engine checks a model's fit against the smaller."""
    files = fake_tree(tmp_path, "0::/pod/app\n", V2_MOUNT, {
        "sys/fs/cgroup/pod/memory.max": f"{4 << 30}\n",
        "sys/fs/cgroup/pod/memory.current": f"{3 << 30}\n",
        "sys/fs/cgroup/pod/memory.stat": f"anon {2 << 30}\ninactive_file {1 << 30}\n",
        "sys/fs/cgroup/pod/app/memory.max": "max\n",
        "sys/fs/cgroup/pod/app/memory.current": f"{3 << 30}\n"})
    monkeypatch.setattr(memory, "_meminfo", lambda field, path: 8 << 30)     # the host's MemAvailable
    assert cgroup_headroom(files) == 2 << 30
    assert available_bytes(files) == 2 << 30


def test_v1_without_a_memory_limit_leaves_the_hosts_figure(tmp_path, monkeypatch):
    files = fake_tree(tmp_path, "4:memory:/c1\n", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n", {
        "sys/fs/cgroup/memory/c1/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/memory/c1/memory.usage_in_bytes": "6684942336\n"})
    monkeypatch.setattr(memory, "_meminfo", lambda field, path: 8 << 30)
    assert cgroup_headroom(files) is None
    assert available_bytes(files) == 8 << 30


def test_threads_are_the_mask_or_the_quota_rounded_down():
    assert CpuBudget(8).threads == 8
    assert CpuBudget(8, 1.5).threads == 1
    assert CpuBudget(8, 2.5).threads == 2
    assert CpuBudget(2, 0.5).threads == 1
    assert CpuBudget(1, 4.0).threads == 1
    assert "a CPU quota of 1.5" in CpuBudget(8, 1.5).describe()


BUDGET = "import json; from verifier.cpu.cpus import cpu_budget; print(json.dumps(cpu_budget().as_json()))"


def run_python(code: str, **kw) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw).stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs in the affinity mask")
def test_affinity_mask_sets_the_engine_threads(tiny_llama_dir):
    """A process pinned to one CPU (taskset) gets a budget of 1 thread, and its engine runs 1."""
    cpu = min(os.sched_getaffinity(0))
    code = ("import json, torch; from spec.engine import LLMEngine; from spec.config import EngineConfig\n"
            f"e = LLMEngine(EngineConfig(model={str(tiny_llama_dir)!r}, max_model_len=64, num_kv_blocks=8))\n"
            "print(json.dumps([e.cpu_budget.threads, e.num_threads, torch.get_num_threads(), e.threads.active]))")
    out = run_python(code, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert json.loads(out.splitlines()[-1]) == [1, 1, 1, False]


@pytest.mark.parametrize("quota, threads", [(1.5, 1), (0.5, 1)])
def test_a_real_cgroup_quota_sets_the_budget(quota, threads):
    """A process started in a cgroup with a CPU quota reads it back: 1.5 CPUs give 1 thread
    (rounded down: a throttled thread stalls the others at every barrier), 0.5 gives 1."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs in the affinity mask")
    made = make_cgroup(quota)
    if made is None:
        pytest.skip("this machine does not let the test make a cgroup with a CPU quota")
    d, procs = made
    try:
        out = run_python(BUDGET, preexec_fn=lambda: (d / procs).write_text(str(os.getpid())))
        assert json.loads(out) == {"threads": threads, "affinity_cpus": len(os.sched_getaffinity(0)),
                                   "quota_cpus": quota}
    finally:
        d.rmdir()


def test_this_process_budget_is_within_the_mask():
    b = cpu_budget()
    assert 1 <= b.threads <= b.affinity == len(os.sched_getaffinity(0))


class FakeStat:
    """/proc/stat for the CPUs of this process's mask, with idle ticks the test sets, and the
    clocks the meters read."""
    def __init__(self, path: Path, monkeypatch):
        self.path, self.now, self.own, self.idle_ticks = path, 100.0, 0.0, 0
        self.cpus = sorted(os.sched_getaffinity(0))
        monkeypatch.setattr("verifier.cpu.cpus.time.monotonic", lambda: self.now)
        self.write()

    def write(self):
        lines = ["cpu  1 0 1 0 0 0 0 0 0 0"] + [f"cpu{c} 1 0 1 {self.idle_ticks // len(self.cpus)} 0 0 0 0 0 0"
                                               for c in self.cpus]
        self.path.write_text("\n".join(lines) + "\n")

    def advance(self, seconds: float, idle_cpus: float, own_cpus: float):
        self.now += seconds
        self.idle_ticks += int(idle_cpus * seconds * os.sysconf("SC_CLK_TCK"))     # over all the CPUs
        self.own += own_cpus * seconds
        self.write()


def test_idle_and_neighbour_meters_read_the_mask_cpus(tmp_path, monkeypatch):
    """Idle CPUs over each window; a neighbour's share is what neither idled nor this process
    used, and a thread count leaves it its CPU (the budget caps it; never below 1)."""
    from verifier.cpu.cpus import FreeCpus, IdleMeter, NeighbourMeter
    stat = FakeStat(tmp_path / "stat", monkeypatch)
    n = len(stat.cpus)
    idle = IdleMeter(tmp_path / "stat")
    free = FreeCpus(NeighbourMeter(tmp_path / "stat", own=lambda: stat.own), min_window=0,
                    clock=lambda: stat.now)         # a reading on every call
    stat.advance(1.0, idle_cpus=n - 1, own_cpus=0.8)       # this process near one CPU, the rest idle
    assert idle() == pytest.approx(n - 1, abs=0.05)
    assert free(n) == n
    stat.advance(1.0, idle_cpus=max(0, n - 2), own_cpus=1.0)   # a neighbour on one more
    assert free(n) == max(1, n - 1)
    assert free(1) == 1
    stat.advance(1.0, idle_cpus=n, own_cpus=0.0)
    assert free(n) == n


def test_meters_without_proc_stat_say_unknown(tmp_path):
    from verifier.cpu.cpus import FreeCpus, IdleMeter, NeighbourMeter
    assert IdleMeter(tmp_path / "missing")() is None
    assert FreeCpus(NeighbourMeter(tmp_path / "missing"), min_window=0)(3) == 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs in the affinity mask")
def test_readers_in_turn_share_one_window_and_a_short_one_gives_the_last_answer(tmp_path, monkeypatch):
    """The process-wide reading (the engine's load, the test suite's thread counts): the budget
    before any window closes, and within min_window of a reading its answer again, since a window
    that short is mostly the rounding of /proc/stat's ticks."""
    from verifier.cpu.cpus import FreeCpus, NeighbourMeter
    stat = FakeStat(tmp_path / "stat", monkeypatch)
    n = len(stat.cpus)
    free = FreeCpus(NeighbourMeter(tmp_path / "stat", own=lambda: stat.own), min_window=0.25,
                    clock=lambda: stat.now)
    assert free(n) == n
    stat.advance(1.0, idle_cpus=n - 2, own_cpus=1.0)     # a neighbour on one CPU
    assert free(n) == n - 1
    stat.advance(0.1, idle_cpus=n, own_cpus=0.0)         # gone, but for too short a window to tell
    assert free(n) == n - 1
    assert free(1) == 1
    stat.advance(1.0, idle_cpus=n, own_cpus=0.0)
    assert free(n) == n


def test_cached_timings_are_measured_on_the_count_they_are_for(tmp_path, neighbours):
    """A kernel choice measured on the threads the forwards will run on, whatever the caller's
    count, cached under that count, and the caller's count set back."""
    import torch

    from verifier.cpu.machine import cached_measurement
    seen = []

    def measure() -> dict:
        seen.append(torch.get_num_threads())
        return {"ms": 1.0}
    torch.set_num_threads(1)
    args = (tmp_path, "t-", {"what": "test"}, measure, dict, dict)
    assert cached_measurement(*args, threads=2) == {"ms": 1.0} and seen == [2]
    assert torch.get_num_threads() == 1
    cached_measurement(*args, threads=2)
    assert seen == [2]                                   # read back from the cache
    cached_measurement(*args)
    assert seen == [2, 1]                                # another count, another measurement
    assert len(list(tmp_path.glob("t-*.json"))) == 2


def test_timings_taken_beside_a_busy_neighbour_serve_the_load_but_are_not_cached(tmp_path, neighbours):
    """A measurement while other processes kept a CPU busy is used, not written: the next load
    measures again (a neighbour during the attention timings once made serial attention stick
    on a machine where all threads are faster). Quiet, or with the neighbours on CPUs its
    threads never needed, it is written and read back."""
    from verifier.cpu import machine
    seen = []

    def measure() -> dict:
        seen.append(len(seen))
        return {"ms": float(len(seen))}
    args = (tmp_path, "t-", {"what": "test"}, measure, dict, dict)
    neighbours(0.9)
    assert machine.cached_measurement(*args, threads=2) == {"ms": 1.0}
    assert not list(tmp_path.glob("t-*.json"))
    neighbours(5.0, cpus=16)     # a big host's other tenants, on CPUs the two threads never needed
    assert machine.cached_measurement(*args, threads=2) == {"ms": 2.0}
    neighbours(0.9)
    assert machine.cached_measurement(*args, threads=2) == {"ms": 2.0}      # read back
    assert len(seen) == 2 and len(list(tmp_path.glob("t-*.json"))) == 1


def test_the_engine_loads_on_the_free_cpus_and_leaves_the_callers_count(tiny_llama_dir, monkeypatch):
    """Beside a neighbour (one CPU free) the target loads and warms up on one thread, its kernel
    choices are timed on the engine's count, steps run on the governor's, and the caller's own
    count is the same after the load and after the steps."""
    import torch

    from spec.llm import LLM
    from spec.threads import ThreadConfig
    from verifier.sampling.sampling_params import SamplingParams
    from verifier.target import TargetModel
    loads, forwards = [], []
    init, forward = TargetModel.__init__, TargetModel.forward

    def recording_init(self, *args, **kw):
        loads.append((torch.get_num_threads(), kw.get("tune_threads")))
        init(self, *args, **kw)

    def recording_forward(self, batch):
        forwards.append(torch.get_num_threads())
        return forward(self, batch)
    monkeypatch.setattr(TargetModel, "__init__", recording_init)
    monkeypatch.setattr(TargetModel, "forward", recording_forward)
    monkeypatch.setattr("spec.preparation.free_cpus", lambda budget: 1)
    torch.set_num_threads(3)                             # the caller's, unlike any the engine picks
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, num_threads=2,
              thread_tuning=ThreadConfig(adaptive=False))
    assert loads == [(1, 2)] and forwards and set(forwards) == {1}
    assert torch.get_num_threads() == 3
    forwards.clear()
    llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))
    assert forwards and set(forwards) == {2}
    assert torch.get_num_threads() == 3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs in the affinity mask")
def test_the_engine_takes_torchs_count_where_the_caller_set_it_below_the_budget(tiny_llama_dir):
    """OMP_NUM_THREADS=1 or torch.set_num_threads(1) before the engine: it runs on one thread."""
    import torch

    from spec.llm import LLM
    torch.set_num_threads(1)
    engine = LLM(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8).engine
    assert engine.num_threads == 1 and not engine.threads.active


def test_a_child_process_s_cpu_time_is_the_process_own():
    """The kernels' compiler, run while a first load is metered, is not a neighbour: its CPU time
    counts as the process's own once it has ended (CPU time, whatever runs beside it)."""
    import subprocess
    import sys

    from verifier.cpu.cpus import own_cpu_time
    before = own_cpu_time()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert own_cpu_time() - before >= 0.3
