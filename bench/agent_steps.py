"""The agent workload offline, step by step: where a batch of sessions spends its time.

    python -m bench.agent_steps --clients 4 --sessions 16 --engines none,suffix,suffix:g2:fixed,suffix:g4:fixed

Runs the sessions of bench/agent_workload.py through one engine per name in this process, as
the server's clients would (each of `--clients` workers sends its session's next turn when the
last reply ends, T=0, EOS ends a reply), and times every step: steps that ran a prompt chunk
apart from decode steps (their forwards too), and the decode steps by rows. Names: "none" (no
drafter) or a drafter, with ":gN" (a chain of N) and ":fixed" (the adaptive controller off:
every proposal verified whole). Output tokens are the same for every engine (greedy).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from bench.agent_workload import agent_specs
from bench.step_times import StepTime, timed
from drafters.config import SpecConfig
from spec import LLM, SamplingParams, Submission
from spec.adaptive import AdaptiveConfig
from spec.llm import chat_token_ids


@dataclass
class StepLog:
    """Every step of a run (bench/step_times.py:timed)."""
    steps: list[StepTime] = field(default_factory=list)

    def part(self, prompt: bool) -> tuple[int, float, float]:
        """Steps that ran a prompt chunk (or not): how many, their seconds, their forwards' seconds."""
        sel = [s for s in self.steps if s.prompt == prompt]
        return len(sel), sum(s.step_s for s in sel), sum(s.forward_s for s in sel)


def engine_for(name: str):
    drafter, *opts = name.split(":")
    kw = {}
    for o in opts:
        if o == "fixed":
            kw["adaptive"] = AdaptiveConfig(enabled=False)
        elif o.startswith("g"):
            kw["speculation"] = SpecConfig(num_speculative_tokens=int(o[1:]))
        else:
            raise SystemExit(f"unknown engine option {o!r} in {name!r}: :gN or :fixed")
    return LLM(drafter=None if drafter == "none" else drafter, **kw)


def run(llm, specs, clients: int, max_tokens: int) -> tuple[int, float]:
    """The sessions with `clients` workers; (output tokens, wall seconds)."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=max_tokens)
    items = [s.follow_up({"messages": s.messages()}) for s in specs]
    queue, active, tokens, ids = list(items), {}, 0, iter(range(10 ** 9))

    def send(item, messages, turn):
        rid = f"agent-{next(ids)}"
        engine.add_request(rid, Submission(chat_token_ids(llm.tokenizer, messages), params))
        active[rid] = (item, messages, turn)
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < clients:
            item = queue.pop(0)
            send(item, item.first["messages"], 0)
        for out in engine.step():
            if not out.finished:
                continue
            item, messages, turn = active.pop(out.request_id)
            tokens += len(out.token_ids)
            user = item.next_user(turn, out.text)
            if user is not None:
                send(item, [*messages, {"role": "assistant", "content": out.text}, {"role": "user", "content": user}],
                     turn + 1)
    return tokens, time.perf_counter() - start


def report(name: str, tokens: int, wall: float, log: StepLog, base: float | None) -> str:
    n_p, t_p, f_p = log.part(True)
    n_d, t_d, f_d = log.part(False)
    ratio = f", {tokens / wall / base:.2f}x none" if base else ""
    lines = [f"{name}: {tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tok/s{ratio}; "
             f"steps with a prompt chunk {n_p} ({t_p:.2f} s, forwards {f_p:.2f}), decode steps {n_d} "
             f"({t_d:.2f} s, forwards {f_d:.2f})"]
    by_rows: dict[int, list] = {}
    for s in log.steps:
        if not s.prompt:
            by_rows.setdefault(min(s.rows // 8 * 8, 64), []).append((s.forward_s, s.step_s))
    for r in sorted(by_rows):
        xs = by_rows[r]
        fwd, step = (1e3 * statistics.median(x[i] for x in xs) for i in (0, 1))
        lines.append(f"  decode rows {r}-{r + 7}: {len(xs)} steps, forward {fwd:.1f} ms, step {step:.1f} ms (median), "
                     f"{sum(x[1] for x in xs):.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="none,suffix")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--skip", type=int, default=0, help="sessions passed over first (another sample)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = agent_specs(1 + args.skip + args.sessions)
    specs = specs[:1] + specs[1 + args.skip:]
    base = None
    for name in args.engines.split(","):
        llm = engine_for(name)
        run(llm, specs[:1], 1, args.max_tokens)          # warm-up on a session the run does not send
        log = StepLog(timed(llm.engine))
        tokens, wall = run(llm, specs[1:], args.clients, args.max_tokens)
        base = base or (tokens / wall if name == "none" else None)
        print(report(name, tokens, wall, log, base), flush=True)
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
