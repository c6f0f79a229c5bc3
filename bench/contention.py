"""Speed on a shared CPU: each engine quiet and beside one busy neighbour, interleaved.

    python -m bench.contention --limit 4 --max-tokens 96 --repeats 2
    python -m bench.contention --quota 1.5          # in a cgroup holding 1.5 CPUs (needs root)

The neighbour is one process that busy-loops (`while True: pass`), as a browser tab, another
pod on the node or a CI job would take a core. For each engine and setting, each round runs
its requests quiet and beside the neighbour, in alternating order (ABBA over rounds), so a
drift of the machine falls on both; the figure is the median tok/s over rounds and the ratio
busy / quiet. Engines:

- `server`: `tercel serve` in its own process (`--drafter`, `--threads`), T=0 chat requests
  streamed at concurrency 1 and 4, speculation "off" and "auto"; with `--fixed-threads-too`
  also the server with `--fixed-threads` (every step on all threads, as before the governor).
- `offline`: the offline API in this process, plain and with the drafter, batches of 1 and 4.
- `llamacpp`: llama-cpp-python on the same GGUF and threads (an optional extra), batch 1.

Where the time goes, per setting: the CPU seconds the engine's process used per token, its
context switches per token (voluntary: a thread waited; involuntary: the kernel took its core),
the thread count its steps ended on, its steps and their seconds on each thread count (the
governor's probes and switches; `tercel_thread_steps` in the server), and for the server the
/health latency while it served (the event loop's lag). `--quota Q` instead runs the offline
engine, plain, in a new cgroup with a CPU quota of Q, at each fixed thread count and with the
governor.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.data import mtbench_first_turns
from bench.llamacpp import LlamaCppGenerator, check_llamacpp
from bench.serve_load import launch_server
from spec import LLM, SamplingParams
from spec.threads import ThreadConfig
from verifier.cpu.cpus import cpu_budget
from verifier.cpu.machine import machine_summary
from verifier.model.loader import DEFAULT_MODEL, resolve_model_dir
from verifier.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
NEIGHBOUR = [sys.executable, "-c", "while True: pass"]


@contextlib.contextmanager
def neighbour(busy: bool):
    """One process busy-looping on one core while the block runs (nothing if not `busy`)."""
    proc = subprocess.Popen(NEIGHBOUR) if busy else None
    try:
        if proc is not None:
            time.sleep(0.3)
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class ProcCounters:
    """A process's CPU time and context switches, summed over its threads (/proc)."""
    cpu_s: float = 0.0
    voluntary: int = 0
    involuntary: int = 0

    @classmethod
    def read(cls, pid: int) -> "ProcCounters":
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        vol = invol = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        return cls(cpu, vol, invol)

    def __sub__(self, o: "ProcCounters") -> "ProcCounters":
        return ProcCounters(self.cpu_s - o.cpu_s, self.voluntary - o.voluntary, self.involuntary - o.involuntary)


@dataclass
class Run:
    """One round of one setting: tokens out, wall seconds, and what the process did meanwhile."""
    tokens: int
    seconds: float
    counters: ProcCounters
    threads: int | None = None          # the engine's thread count at the end (None: not known)
    health_ms: list[float] = field(default_factory=list)
    thread_steps: dict[int, tuple[int, float]] = field(default_factory=dict)   # threads -> (steps, seconds)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


# ---- engines ----------------------------------------------------------------------------------
class Server:
    def __init__(self, args, port: int, fixed_threads: bool):
        serve = ["--drafter", args.drafter, "--log-level", "warning"] \
            + (["--threads", str(args.threads)] if args.threads else []) + (["--fixed-threads"] if fixed_threads else [])
        self.proc, self.url = launch_server(serve, port, cwd=ROOT)
        self.max_tokens = args.max_tokens

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def run(self, prompts: list[str], speculation: str) -> Run:
        body = lambda p: {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": p}],  # noqa: E731
                          "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True}, "speculation": speculation}
        stop, health, steps_before = threading.Event(), [], self._thread_steps()
        poller = threading.Thread(target=_poll_health, args=(self.url, stop, health))
        before, start = ProcCounters.read(self.proc.pid), time.perf_counter()
        poller.start()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tokens = sum(pool.map(lambda p: _stream(self.url, body(p)), prompts))
        seconds = time.perf_counter() - start
        stop.set()
        poller.join()
        threads = httpx.get(f"{self.url}/health").json().get("threads")
        return Run(tokens, seconds, ProcCounters.read(self.proc.pid) - before, threads, health,
                   _minus(self._thread_steps(), steps_before))

    def _thread_steps(self) -> dict[int, tuple[int, float]]:
        """Engine steps and their seconds by thread count so far (/metrics)."""
        out: dict[int, list] = {}
        for f in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for smp in f.samples:
                if smp.name in ("tercel_thread_steps_total", "tercel_thread_step_seconds_total"):
                    seconds = smp.name.endswith("seconds_total")
                    out.setdefault(int(smp.labels["threads"]), [0, 0.0])[seconds] += smp.value
        return {n: (int(v[0]), v[1]) for n, v in out.items()}


def _minus(after: dict[int, tuple[int, float]], before: dict[int, tuple[int, float]]) -> dict[int, tuple[int, float]]:
    """Steps and seconds by thread count between two readings (counts with no new step left out)."""
    out = {n: (s - before.get(n, (0, 0.0))[0], t - before.get(n, (0, 0.0))[1]) for n, (s, t) in after.items()}
    return {n: v for n, v in out.items() if v[0] > 0}


def _stream(url: str, body: dict) -> int:
    """Completion tokens of one streamed chat request."""
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def _poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.wait(0.05):
            start = time.perf_counter()
            client.get(f"{url}/health")
            out.append((time.perf_counter() - start) * 1e3)


class Offline:
    def __init__(self, args, drafter: str | None, fixed_threads: bool = False):
        self.llm = LLM(drafter=drafter, num_threads=args.threads, thread_tuning=ThreadConfig(adaptive=not fixed_threads))
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def run(self, prompts: list[str], _speculation: str = "") -> Run:
        steps_before = self._thread_steps()
        before, start = ProcCounters.read(os.getpid()), time.perf_counter()
        outs = self.llm.chat([[{"role": "user", "content": p}] for p in prompts], self.params)
        seconds = time.perf_counter() - start
        return Run(sum(len(o.token_ids) for o in outs), seconds, ProcCounters.read(os.getpid()) - before,
                   self.llm.engine.stats().threads, thread_steps=_minus(self._thread_steps(), steps_before))

    def _thread_steps(self) -> dict[int, tuple[int, float]]:
        return {t.threads: (t.steps, t.seconds) for t in self.llm.engine.stats().thread_steps}

    def close(self) -> None:
        self.llm.close()


class LlamaCpp:
    def __init__(self, args):
        check_llamacpp(DEFAULT_MODEL)
        self.tokenizer = Tokenizer(resolve_model_dir(DEFAULT_MODEL))      # the same chat template
        self.gen = LlamaCppGenerator(DEFAULT_MODEL, args.max_tokens, False, args.threads or cpu_budget().threads,
                                     self.tokenizer)

    def run(self, prompts: list[str], _speculation: str = "") -> Run:
        before, start, tokens = ProcCounters.read(os.getpid()), time.perf_counter(), 0
        for p in prompts:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            tokens += len(self.gen.generate(ids, 0.0, 0).token_ids)
        return Run(tokens, time.perf_counter() - start, ProcCounters.read(os.getpid()) - before)

    def close(self) -> None:
        pass


# ---- rounds -------------------------------------------------------------------------------------
@dataclass
class Setting:
    """One row of the report: an engine, its batch and speculation, and its runs per condition."""
    engine: str
    concurrency: int
    speculation: str
    runs: dict[str, list[Run]] = field(default_factory=lambda: {"quiet": [], "busy": []})

    def median_tok_s(self, condition: str) -> float:
        return statistics.median(r.tok_s for r in self.runs[condition])

    @property
    def ratio(self) -> float:
        return self.median_tok_s("busy") / self.median_tok_s("quiet")

    def per_token(self, condition: str, what: str) -> float:
        runs = self.runs[condition]
        return sum(getattr(r.counters, what) for r in runs) / max(1, sum(r.tokens for r in runs))

    def thread_steps(self, condition: str) -> dict[int, tuple[int, float]]:
        """Steps and their seconds by thread count, summed over the condition's runs."""
        total: dict[int, tuple[int, float]] = {}
        for r in self.runs[condition]:
            for n, (steps, secs) in r.thread_steps.items():
                s0, t0 = total.get(n, (0, 0.0))
                total[n] = (s0 + steps, t0 + secs)
        return dict(sorted(total.items()))

    def as_json(self) -> dict:
        d = {"engine": self.engine, "concurrency": self.concurrency, "speculation": self.speculation,
             "ratio": round(self.ratio, 3)}
        for c in ("quiet", "busy"):
            runs = self.runs[c]
            health = [h for r in runs for h in r.health_ms]
            d[c] = {"tok_s": [round(r.tok_s, 1) for r in runs], "median_tok_s": round(self.median_tok_s(c), 1),
                    "cpu_ms_per_token": round(1e3 * self.per_token(c, "cpu_s"), 2),
                    "voluntary_switches_per_token": round(self.per_token(c, "voluntary"), 1),
                    "involuntary_switches_per_token": round(self.per_token(c, "involuntary"), 1),
                    "threads": [r.threads for r in runs],
                    "thread_steps": {str(n): {"steps": st, "seconds": round(t, 2)}
                                     for n, (st, t) in self.thread_steps(c).items()},
                    "health_ms": {"median": round(statistics.median(health), 1), "max": round(max(health), 1)}
                    if health else None}
        return d


def measure(engine, name: str, levels: list[tuple[int, str]], prompts: list[str], repeats: int) -> list[Setting]:
    """Each (concurrency, speculation) level, each repeat and prompt group, quiet and busy in
    alternating order."""
    settings = [Setting(name, c, level) for c, level in levels]
    engine.run(prompts[:1], levels[0][1])                   # warm: caches, first shapes
    k = 0
    for _ in range(repeats):
        for s in settings:
            for group in _groups(prompts, s.concurrency):
                order = ("quiet", "busy") if k % 2 == 0 else ("busy", "quiet")
                k += 1
                for condition in order:
                    with neighbour(condition == "busy"):
                        s.runs[condition].append(engine.run(group, s.speculation))
                print(f"{name} c={s.concurrency} {s.speculation}: quiet {s.runs['quiet'][-1].tok_s:.1f} "
                      f"busy {s.runs['busy'][-1].tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return settings


def _groups(prompts: list[str], c: int) -> list[list[str]]:
    """The prompts in groups of c (a batch of 1 is each prompt; of 4, consecutive ones)."""
    return [[prompts[(i + j) % len(prompts)] for j in range(c)] for i in range(0, len(prompts), c)]


def report(settings: list[Setting]) -> str:
    lines = ["| engine | batch | speculation | quiet tok/s | busy tok/s | busy / quiet | threads at the end (quiet / busy) "
             "| CPU ms per token (quiet / busy) | involuntary switches per token (quiet / busy) "
             "| /health ms median / max (busy) | busy steps (seconds) by threads |", "|" + "---|" * 11]
    for s in settings:
        quiet, busy = s.as_json()["quiet"], s.as_json()["busy"]
        health = "-" if busy["health_ms"] is None else "{median} / {max}".format(**busy["health_ms"])
        lines.append(f"| {s.engine} | {s.concurrency} | {s.speculation} | {s.median_tok_s('quiet'):.1f} "
                     f"| {s.median_tok_s('busy'):.1f} | **{s.ratio:.2f}** | {_threads(quiet['threads'])} / {_threads(busy['threads'])} "
                     f"| {1e3 * s.per_token('quiet', 'cpu_s'):.1f} / {1e3 * s.per_token('busy', 'cpu_s'):.1f} "
                     f"| {s.per_token('quiet', 'involuntary'):.1f} / {s.per_token('busy', 'involuntary'):.1f} "
                     f"| {health} | {_steps_text(s.thread_steps('busy'))} |")
    return "\n".join(lines)


def _steps_text(steps: dict[int, tuple[int, float]]) -> str:
    return "-" if not steps else "; ".join(f"{n}: {st} ({t:.1f} s)" for n, (st, t) in steps.items())


def _threads(counts: list[int | None]) -> str:
    known = [c for c in counts if c is not None]
    return "-" if not known else ",".join(str(c) for c in sorted(set(known)))


# ---- a CPU quota ----------------------------------------------------------------------------------
def make_cgroup(quota_cpus: float) -> tuple[Path, str] | None:
    """A new cgroup with this CPU quota (v2 where its cpu controller is on, else v1), or None
    where this process may not make one: (its directory, the file that takes a pid)."""
    period = 100_000
    candidates = [(Path("/sys/fs/cgroup"), "cpu.max", f"{int(quota_cpus * period)} {period}", "cgroup.procs"),
                  (Path("/sys/fs/cgroup/cpu"), "cpu.cfs_quota_us", str(int(quota_cpus * period)), "tasks")]
    for parent, knob, value, procs in candidates:
        try:
            if knob == "cpu.max" and "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                continue
            d = parent / f"tercel-{os.getpid()}-{time.monotonic_ns() % 10**9}"
            d.mkdir()
        except OSError:
            continue
        try:
            (d / knob).write_text(value)
            return d, procs
        except OSError:
            d.rmdir()
    return None


def quota_runs(args, prompts: list[str]) -> list[dict]:
    """The offline engine, plain, in a cgroup holding `args.quota` CPUs: at each fixed thread
    count up to the CPUs and with the governor (the default), in alternating order."""
    made = make_cgroup(args.quota)
    if made is None:
        raise SystemExit("--quota needs a cgroup with a CPU quota, which this process may not make (root?)")
    d, procs = made
    counts = list(range(1, len(os.sched_getaffinity(0)) + 1))
    variants = [("fixed", n) for n in counts] + [("governor", None)]
    results: dict[tuple, list[float]] = {v: [] for v in variants}
    try:
        for r in range(args.repeats):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                cmd = [sys.executable, "-m", "bench.contention", "--child", json.dumps(
                    {"threads": v[1], "fixed": v[0] == "fixed", "prompts": prompts, "max_tokens": args.max_tokens})]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                                     preexec_fn=lambda: (d / procs).write_text(str(os.getpid())))
                results[v].append(json.loads(out.stdout.splitlines()[-1])["tok_s"])
                print(f"quota {args.quota}: {v}: {results[v][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        d.rmdir()
    return [{"threads": v[1] or "governor", "tok_s": results[v], "median_tok_s": round(statistics.median(results[v]), 1)}
            for v in variants]


def child(job: dict) -> None:
    """One quota run, in the cgroup: the plain offline engine over the prompts, one at a time."""
    llm = LLM(num_threads=job["threads"], thread_tuning=ThreadConfig(adaptive=not job["fixed"]))
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    llm.chat([{"role": "user", "content": job["prompts"][0]}], params)      # warm
    start, tokens = time.perf_counter(), 0
    for p in job["prompts"]:
        tokens += len(llm.chat([{"role": "user", "content": p}], params)[0].token_ids)
    print(json.dumps({"tok_s": tokens / (time.perf_counter() - start), "threads": llm.engine.stats().threads}))


# ---- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="server,offline,llamacpp", help="server, offline, llamacpp")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--drafter", default="ngram", help="the server's and the offline API's drafter")
    ap.add_argument("--threads", type=int, default=None, help="threads at most (default: the CPU budget)")
    ap.add_argument("--fixed-threads-too", action="store_true", help="also the server with --fixed-threads")
    ap.add_argument("--limit", type=int, default=4, help="MT-bench first turns")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--quota", type=float, default=None, help="run the quota comparison in a cgroup instead")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    machine = f"{machine_summary()}; CPU budget {cpu_budget().describe()}"
    prompts = mtbench_first_turns(args.limit)
    if args.quota is not None:
        rows = quota_runs(args, prompts)
        print(f"CPU quota {args.quota}, offline plain, {machine}")
        for row in rows:
            print(f"- threads {row['threads']}: {row['median_tok_s']} tok/s (runs {row['tok_s']})")
        _write(args.json, {"machine": machine, "quota": args.quota, "runs": rows})
        return
    settings = _all_settings(args, prompts)
    print(f"{machine}; one busy-looping neighbour; medians over {args.repeats} x {len(prompts)} prompts")
    print(report(settings))
    _write(args.json, {"machine": machine, "settings": [s.as_json() for s in settings]})


def _all_settings(args, prompts: list[str]) -> list[Setting]:
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = args.engines.split(",")
    settings: list[Setting] = []
    if "server" in engines:
        for fixed in ([False, True] if args.fixed_threads_too else [False]):
            server = Server(args, args.port, fixed)
            try:
                name = "server, fixed threads" if fixed else "server"
                settings += measure(server, name, [(c, m) for c in levels for m in ("off", "auto")], prompts,
                                    args.repeats)
            finally:
                server.close()
    if "offline" in engines:
        for drafter in (None, args.drafter):
            engine = Offline(args, drafter)
            try:
                settings += measure(engine, f"offline, {drafter or 'plain'}", [(c, "") for c in levels], prompts,
                                    args.repeats)
            finally:
                engine.close()
    if "llamacpp" in engines:
        try:
            settings += measure(LlamaCpp(args), "llama.cpp", [(1, "")], prompts, args.repeats)
        except ValueError as e:           # the optional extra is not installed
            print(f"llama.cpp skipped: {e}", file=sys.stderr)
    return settings


def _write(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
