"""What a lookup drafter could gain at best on this machine: the target's greedy replies replayed
through the drafter, without running the target again, against this machine's verify-cost curve.

    python -m bench.replay --tasks summarization,rag,mtbench --drafters suffix,tree:suffix+ngram --limit 5 --threads 2
    tercel bench replay --drafter suffix,ngram --tasks summarization,rag --limit 5 --max-tokens 128 --ignore-eos

Per task: the plain engine's greedy replies (as bench.speculative runs them: `--new-tokens`, past
EOS), what a forward costs at 1 to N rows after the prompts' median length (a decode row, then
bench.row_costs' trees; row counts interleaved), and what a prompt's prefill costs. Each
drafter then proposes at every step of every reply, with its default tree's limits, and the
step takes the longest path of the tree that the reply follows. Per drafter:

- tau: tokens per step when every step verifies the whole tree (steps without a draft count);
  drafted: the share of steps with a draft; nodes: draft nodes per step; propose: ms per step;
- bounds on the speedup over plain decoding, of the decode and end to end (each prompt's
  prefill counted once on both sides): "oracle", every step verifying only the path that is
  accepted (what a controller that knew the outcome would verify: none that decides before the
  target's logits, as an exact one must, can do better), and "whole", every step verifying the
  whole tree; and "policy", the engine's adaptive controller choosing each step's nodes from
  the same curve (a replay of its own, since its cuts change where each step starts), which
  says how much of the oracle's gain the controller takes. The engine's own work per step
  (scheduling, acceptance: about 0.3-0.8 ms, more for trees) is left out of every column, so
  the figures are optimistic.

Lookup drafters only (n-gram, datastore, suffix and `tree:` of them): a draft model or an
EAGLE head would need the target's states, which a replay does not have.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from bench.cli_args import split_names
from bench.data import load_datasets
from bench.row_costs import cached_prefix, tree_batch
from bench.speculative import prompt_sets
from drafters.base import DraftRequest, Drafter, Proposal
from drafters.kinds import build_drafter, default_speculation
from spec import LLM, SamplingParams
from spec.adaptive import AdaptiveConfig, AdaptiveController, Candidate, SpecHistory
from spec.step_cost import CostCurve, StepCost, StepSample
from spec.threads import ThreadConfig
from tree.token_tree import TokenTree
from verifier.batch import ForwardBatch, SeqInput
from verifier.cpu.machine import machine_summary


ROUNDS = 30          # forwards per row count for a task's cost curve


@dataclass(frozen=True)
class Reply:
    prompt: list[int]
    output: list[int]


@dataclass
class Replayed:
    """One drafter over one task's replies: per step, (draft nodes, nodes accepted)."""
    steps: list[tuple[int, int]]
    propose_s: float

    @property
    def tau(self) -> float:
        return sum(a + 1 for _, a in self.steps) / len(self.steps)


@dataclass(frozen=True)
class Costs:
    """A task's measured costs: one forward by rows, and one prompt's prefill, in ms."""
    forward: CostCurve
    prefill_ms: float


def accepted(tree: TokenTree, future: list[int]) -> int:
    """How many draft nodes a step keeps when the reply goes on with `future` (greedy)."""
    return len(tree.follow(future))


class Policy:
    """The engine's adaptive controller (spec/adaptive.py) over one replayed request at a time,
    its step costs taken from the measured curve: what the engine would verify, without the
    host's noise (the engine's own work around each forward is left out, as in the bounds)."""

    def __init__(self, curve: CostCurve, config: AdaptiveConfig = AdaptiveConfig()):
        self.controller = AdaptiveController(config, StepCost(curve, config.smoothing))
        self.history: SpecHistory | None = None

    def start(self) -> None:
        self.history = self.controller.history()

    def drafts(self) -> bool:
        return self.controller.drafts(self.history, 1, 1)

    def cut(self, prop: Proposal) -> Proposal | None:
        """The proposal as verified (None: a plain step)."""
        if not prop.num_draft_nodes:
            return None
        (keep,) = self.controller.trim([self._candidate(prop)], 1, 1)
        return prop.truncated(keep) if keep else None

    def observe(self, verified: Proposal | None, path: list[int], drafted: bool, draft_s: float) -> None:
        nodes = verified.num_draft_nodes if verified is not None else 0
        if verified is not None:
            self.controller.observe(self._candidate(verified), path)
        forward_s = self.controller.cost.curve(1 + nodes) / 1e3
        self.controller.cost.observe(StepSample(1 + nodes, 1, int(drafted), nodes, False, forward_s, draft_s,
                                                forward_s + draft_s))

    def _candidate(self, prop: Proposal) -> Candidate:
        return Candidate(self.history, prop.tree.depths[1:], prop.scores, prop.score_kind)


def replay(drafter: Drafter, replies: list[Reply], limits, params: SamplingParams,
           policy: Policy | None = None) -> Replayed:
    """Each reply step by step as the engine would draft it (seq ids in order, each finished
    after its reply, so suffix decoding sees the earlier replies, as in bench.speculative).
    Without a policy every step verifies the whole tree; with one, what the policy keeps."""
    drafter.forget_history()
    steps, propose_s = [], 0.0
    for seq, r in enumerate(replies):
        if policy is not None:
            policy.start()
        done = 0                                    # output tokens before this step's root, emitted
        while done < len(r.output) - 1:
            # as the engine's limits: the bonus token of a step never passes the reply's end
            depth = min(limits.num_speculative_tokens, len(r.output) - 2 - done, limits.max_nodes)
            verified, drafted, spent = None, False, 0.0
            if depth >= 1 and (policy is None or policy.drafts()):
                req = DraftRequest(seq, r.prompt + r.output[:done + 1], params, None, max_depth=depth,
                                   max_nodes=limits.max_nodes, topk=limits.topk, num_prompt=len(r.prompt))
                start = time.perf_counter()
                verified = drafter.propose([req])[0]
                spent, drafted = time.perf_counter() - start, True
                if policy is not None:
                    verified = policy.cut(verified)
            tree = verified.tree if verified is not None else TokenTree.single(r.output[done])
            path = tree.follow(r.output[done + 1:])
            if policy is not None:
                policy.observe(verified, path, drafted, spent)
            steps.append((tree.num_nodes - 1, len(path)))
            propose_s += spent
            done += len(path) + 1
        drafter.finish(seq, r.prompt + r.output, len(r.prompt))
        drafter.release(seq)
    return Replayed(steps, propose_s)


def bounds(run: Replayed, cost: Costs, prompts: int, policy: Replayed | None = None) -> dict[str, float]:
    """Speedups over plain decoding: each step's forward at the rows it verifies, plus drafting
    ("oracle" and "whole" from `run`, whole-tree steps; "policy" from `policy`'s own replay)."""
    plain = sum(a + 1 for _, a in run.steps) * cost.forward(1)
    prefill = prompts * cost.prefill_ms
    times = {"oracle": sum(cost.forward(a + 1) for _, a in run.steps) + run.propose_s * 1e3,
             "whole": sum(cost.forward(n + 1) for n, _ in run.steps) + run.propose_s * 1e3}
    if policy is not None:
        times["policy"] = sum(cost.forward(n + 1) for n, _ in policy.steps) + policy.propose_s * 1e3
    out = {f"decode_{k}": plain / t for k, t in times.items()}
    out.update({f"end_to_end_{k}": (prefill + plain) / (prefill + t) for k, t in times.items()})
    out["prefill_share"] = prefill / (prefill + plain)
    return out


def greedy_replies(llm: LLM, conversations: list[list[dict]], params: SamplingParams) -> list[Reply]:
    out = []
    for c in conversations:
        o = llm.generate(llm.apply_chat_template(c), params)[0]
        out.append(Reply(list(o.prompt_token_ids), list(o.token_ids)))
    return out


def forward_ms(llm: LLM, ctx: int, rows: int, rounds: int) -> dict[int, float]:
    """Median ms of one forward after ctx cached tokens: a decode row at 1, a tree of n nodes
    with every node's logits from 2 (bench.row_costs' trees), row counts interleaved per round."""
    target, times = llm.engine.target, {n: [] for n in range(1, rows + 1)}
    with cached_prefix(llm, ctx, rows) as table:
        batches = {n: tree_batch(ctx, n, table, logits=True) for n in range(2, rows + 1)}
        batches[1] = ForwardBatch([SeqInput([100], ctx, table, sampled_from=0)])
        for round_ in range(rounds + 2):       # the first two rounds warm the blocks up, untimed
            for n, batch in batches.items():
                start = time.perf_counter()
                target.forward(batch)
                if round_ >= 2:
                    times[n].append(time.perf_counter() - start)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def measure_costs(llm: LLM, replies: list[Reply], rows: int, rounds: int) -> Costs:
    """The forward's curve after the prompts' median length, and the mean prefill of a prompt
    (its first token, the prefix cache emptied before each)."""
    ctx = int(statistics.median(len(r.prompt) for r in replies))
    ms = forward_ms(llm, ctx, rows, rounds)
    start, one = time.perf_counter(), SamplingParams(temperature=0, max_tokens=1)
    for r in replies:
        llm.engine.reset_prefix_cache()
        llm.generate(r.prompt, one)
    prefill = (time.perf_counter() - start) * 1e3 / len(replies)
    return Costs(CostCurve.measured(ms), prefill)


LOOKUPS = ("ngram", "datastore", "suffix")


def check_lookup(drafter: str) -> None:
    """ValueError unless `drafter` is a lookup drafter or a `tree:` of them (by its string)."""
    kind, _, arg = drafter.partition(":")
    parts = [p.partition(":")[0] for p in filter(None, arg.split("+"))] if kind == "tree" else [kind]
    if not parts or any(p not in LOOKUPS for p in parts):
        raise ValueError(f"bench replay replays lookup drafters only ({', '.join(LOOKUPS)} and tree: of them); "
                         f"{drafter!r} needs the target's states")


def prefill_share(cost: Costs, replies: list[Reply]) -> float:
    """The prefill's share of plain decoding's time over the replies."""
    prefill = len(replies) * cost.prefill_ms
    return prefill / (prefill + sum(len(r.output) - 1 for r in replies) * cost.forward(1))


def task_rows(llm: LLM, drafters: dict[str, Drafter], replies: list[Reply], params: SamplingParams,
              rounds: int) -> dict:
    """One task: its measured costs and, per drafter, tau, drafting and the three speedups."""
    limits = {d: default_speculation(d) for d in drafters}
    cost = measure_costs(llm, replies, max(s.max_nodes for s in limits.values()) + 1, rounds)
    out = {"forward_ms": dict(zip(cost.forward.rows, cost.forward.ms)), "prefill_ms": cost.prefill_ms,
           "prefill_share": prefill_share(cost, replies), "drafters": {}}
    for d, drafter in drafters.items():
        run = replay(drafter, replies, limits[d], params)
        chosen = replay(drafter, replies, limits[d], params, Policy(cost.forward))
        steps = len(run.steps)
        out["drafters"][d] = {"tau": run.tau, "policy_tau": chosen.tau,
                              "drafted": sum(n > 0 for n, _ in run.steps) / steps,
                              "nodes": sum(n for n, _ in run.steps) / steps,
                              "propose_ms": run.propose_s * 1e3 / steps, **bounds(run, cost, len(replies), chosen)}
    return out


def _print_task(task: str, rows: dict) -> None:
    for d, r in rows["drafters"].items():
        print(f"| {task} | {d} | {r['tau']:.2f} | {r['drafted']:.2f} | {r['nodes']:.1f} | {r['propose_ms']:.2f} | "
              f"{r['decode_oracle']:.2f}x / {r['decode_whole']:.2f}x / {r['decode_policy']:.2f}x "
              f"({r['policy_tau']:.2f}) | {r['end_to_end_oracle']:.2f}x / {r['end_to_end_whole']:.2f}x / "
              f"{r['end_to_end_policy']:.2f}x |")
    ms = rows["forward_ms"]
    print(f"| {task} | (prefill {rows['prefill_share']:.0%} of plain's time; 1 row {ms[1]:.2f} ms, "
          f"2 rows {ms[2]:.2f}, 4 rows {ms[4]:.2f}) | | | | | | |", flush=True)


def run(llm: LLM, drafter_names: list[str], tasks: dict[str, list[list[dict]]], new_tokens: int,
        until_eos: set[str], rounds: int = ROUNDS, json_path: str | None = None) -> dict:
    """Every task's replies through every drafter (lookup drafters: `check_lookup`, before the
    model loads); prints the table, returns (and writes) the report."""
    drafters = {d: build_drafter(d, llm.engine.target, default_speculation(d)) for d in drafter_names}
    report = {"machine": machine_summary(), "threads": torch.get_num_threads(), "tasks": {}}
    print(f"{report['machine']}; {report['threads']} threads\n")
    print("| task | drafter | tau | drafted | nodes | propose ms | decode: oracle / whole / policy (its tau) | "
          "end to end: oracle / whole / policy |")
    print("|---|---|---|---|---|---|---|---|")
    for task, conversations in tasks.items():
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=task not in until_eos)
        rows = task_rows(llm, drafters, greedy_replies(llm, conversations, params), params, rounds)
        report["tasks"][task] = rows
        _print_task(task, rows)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
    return report


def run_replay_cli(args) -> int:
    """`tercel bench replay`: the dataset's first turns (--dataset, --tasks, --limit), replies of
    --max-tokens (past EOS with --ignore-eos), the first of --quantization."""
    for d in args.drafter.split(","):
        check_lookup(d)
    data = load_datasets(args.dataset or ["specbench"], split_names(args.tasks), args.limit)
    tasks = {t: [p.messages() for p in ps] for t, ps in data.by_task().items()}
    model = {"model": args.model} if args.model else {}
    llm = LLM(**model, max_num_seqs=1, quantization=args.quantization.split(",")[0],
              thread_tuning=ThreadConfig(adaptive=False))
    until_eos = set() if args.ignore_eos else set(tasks)
    run(llm, args.drafter.split(","), tasks, args.max_tokens, until_eos, json_path=args.json)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="summarization,rag,mtbench")
    ap.add_argument("--drafters", default="suffix")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="forwards per row count for the cost curve")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for d in args.drafters.split(","):
        check_lookup(d)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=1, quantization=args.quantization, thread_tuning=ThreadConfig(adaptive=False))
    run(llm, args.drafters.split(","), prompt_sets(args.tasks.split(","), args.limit), args.new_tokens,
        {"agent"}, args.rounds, args.json)


if __name__ == "__main__":
    main()
