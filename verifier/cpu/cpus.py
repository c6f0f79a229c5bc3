"""How many CPUs this process may use: its affinity mask and its cgroup's CPU quota.

A Kubernetes pod with `limits.cpu: 1500m` still sees every core of its node in `nproc` and
/proc/cpuinfo; what holds it to 1.5 CPUs is the CFS quota of its cgroup (`cpu.max` in cgroup
v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` in v1). Threads beyond the quota only make the
cgroup burn its quota sooner and sit throttled for the rest of each period. So the default
thread count is the smaller of the affinity mask's CPUs and the quota, read as Go (GOMAXPROCS,
1.25) and the JVM (`-XX:+UseContainerSupport`) read theirs, but rounded down where they round
up: a step's threads meet at a barrier hundreds of times per forward, so a throttled thread
stalls them all, and under a quota of 1.5 CPUs one thread served more tokens per second than
two (figures: docs/performance.md, "Shared CPUs"). A limit set on an ancestor cgroup holds its
children too, so the smallest quota on the path to the root counts.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    affinity: int               # CPUs in the process's affinity mask
    quota: float | None = None  # CPUs the cgroup's CFS quota allows; None: no quota

    @property
    def threads(self) -> int:
        """The default thread count: the mask, or the quota rounded down if that is fewer."""
        limit = self.affinity if self.quota is None else min(self.affinity, math.floor(self.quota))
        return max(1, limit)

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g}"
        return (f"{self.threads} thread{'s' * (self.threads != 1)} ({self.affinity} CPU{'s' * (self.affinity != 1)} "
                f"in the affinity mask, {quota})")

    def as_json(self) -> dict:
        return {"threads": self.threads, "affinity_cpus": self.affinity, "quota_cpus": self.quota}


@dataclass(frozen=True)
class ProcFiles:
    """Where the cgroup files are read (tests point it at a fake tree)."""
    cgroup: Path = Path("/proc/self/cgroup")
    mountinfo: Path = Path("/proc/self/mountinfo")
    root: Path = Path("/")            # prefix for the mount points that mountinfo names


def cpu_budget(files: ProcFiles = ProcFiles()) -> CpuBudget:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity, cgroup_quota(files))


def cgroup_quota(files: ProcFiles = ProcFiles()) -> float | None:
    """The smallest CPU quota on the path from this process's cgroup to the root, in CPUs;
    None where there is none or the files cannot be read."""
    try:
        cgroups = files.cgroup.read_text()
        mounts = files.mountinfo.read_text()
    except OSError:
        return None
    quotas = [q for d in controller_dirs(cgroups, mounts, files.root, "cpu") if (q := _dir_quota(d)) is not None]
    return min(quotas, default=None)


def controller_dirs(cgroups: str, mounts: str, root: Path, controller: str) -> list[Path]:
    """The process's cgroup directory for `controller` ("cpu", "memory") and each ancestor up to
    the mount, from /proc/self/cgroup and /proc/self/mountinfo's texts."""
    dirs = []
    for mount_root, mount_point, v2 in _mounts(mounts, controller):
        path = _cgroup_path(cgroups, v2, controller)
        if path is None:
            continue
        # Inside a container the mount's root is the container's own cgroup: strip it.
        rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
        here = root / mount_point.lstrip("/")
        parts = [] if rel in (".", "") else rel.split("/")
        dirs += [here.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return dirs


def _mounts(mounts: str, controller: str) -> list[tuple[str, str, bool]]:
    """(cgroup root, mount point, is v2) of each mount that carries `controller`."""
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[-1].split(",") if len(fields) > sep + 3 else []
        if fstype == "cgroup2" or (fstype == "cgroup" and controller in options):
            found.append((fields[3], fields[4], fstype == "cgroup2"))
    return found


def _cgroup_path(cgroups: str, v2: bool, controller: str) -> str | None:
    """The process's path in the v2 hierarchy (`0::/path`) or the controller's v1 one (`N:cpu,...:/path`)."""
    for line in cgroups.splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v2 and num == "0" and controllers == "":
            return path
        if not v2 and controller in controllers.split(","):
            return path
    return None


def _dir_quota(d: Path) -> float | None:
    """This cgroup directory's own quota in CPUs, or None."""
    try:
        quota, _, period = (d / "cpu.max").read_text().partition(" ")   # v2: "max 100000" or "150000 100000"
        if quota.strip() != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())                # v1: -1 means none
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


class IdleMeter:
    """How many of the process's CPUs sat idle, on average, since the last call (/proc/stat's
    idle and iowait time of the CPUs in its affinity mask). A neighbour that leaves shows here
    at once: the thread governor (spec/threads.py) tries more threads when it does."""

    def __init__(self, stat: Path = Path("/proc/stat")):
        self._stat = stat
        try:
            self._cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self._cpus = set()
        self._last = self._read()

    @property
    def cpus(self) -> int:
        """CPUs in the affinity mask, those the readings cover."""
        return len(self._cpus)

    def _read(self) -> tuple[float, float] | None:
        """(wall seconds, idle CPU-seconds summed over the mask), or None where unreadable."""
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        ticks = sum(int(f[4]) + int(f[5]) for f in (ln.split() for ln in lines) if f and f[0] in self._cpus)
        return time.monotonic(), ticks / os.sysconf("SC_CLK_TCK")

    def __call__(self) -> float | None:
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return (now[1] - last[1]) / (now[0] - last[0])


def own_cpu_time() -> float:
    """CPU seconds of this process and of its children that ended (the C compiler a first load
    runs): work of ours, not a neighbour's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class NeighbourMeter:
    """How many of the process's CPUs other processes kept busy, on average, since the last
    call: the CPUs' busy time (/proc/stat, less idle and iowait) less this process's own CPU
    time (its ended children's included, `own_cpu_time`). Unlike idle CPUs it reads right while
    the process works too; `threads_left` turns a reading into a thread count (a neighbour's CPU
    is not worth a thread whose barriers would wait on it)."""

    def __init__(self, stat: Path = Path("/proc/stat"), own: Callable[[], float] = own_cpu_time):
        self._idle, self._own = IdleMeter(stat), own
        self._last = (time.monotonic(), own())

    @property
    def cpus(self) -> int:
        """CPUs in the affinity mask, those the readings cover."""
        return self._idle.cpus

    def __call__(self) -> float | None:
        idle, now = self._idle(), (time.monotonic(), self._own())
        (t0, own0), self._last = self._last, now
        if idle is None or now[0] <= t0:
            return None
        return max(0.0, self._idle.cpus - idle - (now[1] - own0) / (now[0] - t0))

    def threads_left(self, others: float | None, budget: int) -> int:
        """Threads for the CPUs of the budget that a reading of `others` leaves free (rounded:
        half a CPU counts); the whole budget without a reading."""
        return budget if others is None else max(1, min(budget, int(self._idle.cpus - others + 0.5)))


class FreeCpus:
    """`free(budget)` of a NeighbourMeter whose window is the time since the last reading, or
    the last answer within `min_window` seconds of it (a shorter window is mostly the rounding
    of /proc/stat's ticks); the budget itself before the first window closes."""

    def __init__(self, meter: NeighbourMeter | None = None, min_window: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        self._meter, self._min, self._clock = meter or NeighbourMeter(), min_window, clock
        self._read_at, self._others = clock(), None

    def __call__(self, budget: int) -> int:
        if self._clock() - self._read_at >= self._min:
            self._others, self._read_at = self._meter(), self._clock()
        return self._meter.threads_left(self._others, budget)


# One window for the whole process, open since import: the engine's load and the test suite's
# thread counts read it in turn, so no reader's window is cut short by another's.
free_cpus = FreeCpus()
