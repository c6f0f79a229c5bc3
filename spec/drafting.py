"""The engine's draft phase and every other call it makes on a drafter.

Per step: which decoding requests draft and how much (`plan`: the adaptive controller and the
batch guard), the tree slots each reserves (`lookahead`: the grammar's forced tokens, the
drafter's tree, the prediction's chain), then the proposals (`draft`): the drafter's, joined with
each request's prediction and cut to what the controller verifies. Beside the step: the prompt
chunks, target states and finished outputs a drafter learns from, and releasing a request.
A drafter's exception never fails a request: the step decodes those requests plainly and
`errors` counts it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from drafters.base import DraftRequest, Drafter, PrefillChunk, Proposal, TargetHidden
from drafters.config import SpecConfig
from drafters.prediction import PredictionDrafter, join_prediction
from spec.adapters import Adapters
from spec.adaptive import AdaptiveController, Candidate
from spec.batch_guard import BatchGuard
from spec.constraints import MAX_FORCED, forced_proposal
from spec.plan import SeqPlan
from spec.request import Request
from spec.scheduler import Lookahead, SchedulerOutput
from verifier.batch import ForwardOutput
from verifier.sampling.sampling_params import SamplingParams

log = logging.getLogger("tercel.engine")


@dataclass
class StepDrafts:
    """What this step's drafter.propose cost and gave, for the step's cost sample."""
    seconds: float = 0.0        # in drafter.propose
    requests: int = 0           # requests proposed for
    nodes: int = 0              # draft nodes they got


def pinned(req: Request) -> bool:
    """Seeded sampling reproduces only along one speculation path, so the adaptive
    controller (whose choices depend on timing) leaves seeded sampled requests their trees."""
    return req.params.seed is not None and not req.params.greedy


def candidate(req: Request, prop: Proposal) -> Candidate:
    """A sampled proposal's scores are left out: they would depend on what was drawn, and a
    cut that reads the draws changes the law the nodes came from (rank alone is safe)."""
    scores = prop.scores if prop.draft is None else None
    return Candidate(req.history, prop.tree.depths[1:], scores, prop.score_kind)


class Drafting:
    def __init__(self, drafter: Drafter | None, spec_config: SpecConfig, adaptive: AdaptiveController,
                 guard: BatchGuard, adapters: Adapters, max_model_len: int, max_num_batched_tokens: int,
                 jump_forward: bool, held_back: Callable[[SamplingParams], frozenset[int]]):
        self.drafter, self.spec_config, self.adaptive, self.guard = drafter, spec_config, adaptive, guard
        self.adapters, self.max_model_len, self.chunk = adapters, max_model_len, max_num_batched_tokens
        self.jump_forward, self.held_back = jump_forward, held_back
        self.predictor = PredictionDrafter()   # drafts each request's own prediction, with or without a drafter
        self.errors = 0                         # drafter exceptions caught (requests decoded plainly)
        self.step = StepDrafts()
        self.guarded: tuple[int, bool] | None = None     # this step's (decoding requests, may draft)
        self._caps: dict[int, int | None] = {}   # this step's draft nodes per request (by seq_id; None: its tree's)

    # ---- plan ---------------------------------------------------------------------------------
    def plan(self, running: list[Request]) -> None:
        """Whether each decoding request drafts this step, and how much (a cap of 0: it does not)."""
        self.step, self._caps = StepDrafts(), {}
        if self.drafter is None:
            return
        decoding = [r for r in running if not r.in_prefill]
        base_rows = min(self.chunk, len(decoding) + sum(min(r.num_tokens - r.num_computed_tokens, self.chunk)
                                                        for r in running if r.in_prefill))
        prompt_rows = max(0, base_rows - len(decoding))
        chosen = [r for r in decoding if r.speculate and not pinned(r)]
        allowed = self.guard.speculates(len(decoding))
        # the guard learns from steps where it chose: none where every request decodes plainly anyway
        self.guarded = (len(decoding), allowed) if chosen else None
        for r in chosen:
            r.history = r.history or self.adaptive.history()
            drafts = allowed and self.adaptive.drafts(r.history, len(decoding), base_rows, prompt_rows=prompt_rows)
            self._caps[r.seq_id] = self._nodes_to_draft(r, len(decoding), base_rows, prompt_rows) if drafts else 0

    def _nodes_to_draft(self, req: Request, decoding: int, base_rows: int, prompt_rows: int) -> int | None:
        """A drafter whose time grows per node drafts what the controller expects to pay (None: its tree)."""
        if not self.drafter.drafts_per_node:
            return None
        most = (req.speculation or self.spec_config).max_nodes
        return self.adaptive.nodes_to_draft(req.history, decoding, base_rows, most, prompt_rows=prompt_rows)

    def lookahead(self, req: Request) -> Lookahead:
        """Tree slots a decoding request needs this step: its grammar's forced tokens if it
        forces any (jump-forward; carried to its plan), and the drafter's tree (below them:
        only a drafter that drafts ahead)."""
        try:
            forced = tuple(self._forced(req))
        except Exception as e:   # this request's grammar: it fails alone, in emit
            return Lookahead(fault=e)
        return Lookahead(len(forced) + max(self._drafter_nodes(req, forced), self._prediction_depth(req, forced)),
                         forced)

    def _room(self, req: Request) -> int:
        """Tokens the request may still emit: never past max_tokens or the context."""
        return min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)

    def _drafter_nodes(self, req: Request, forced: tuple[int, ...]) -> int:
        """Draft nodes the drafter may propose this step: below forced tokens only if it drafts ahead."""
        ahead = not forced or (self.drafter is not None and self.drafter.drafts_ahead)
        return self.spec_limits(req, forced)[1] if ahead else 0

    def _prediction_depth(self, req: Request, forced: tuple[int, ...]) -> int:
        """The prediction's chain this step: as deep as the request's tree goes (γ), below its
        forced tokens, never past max_tokens or the context."""
        if req.prediction is None:
            return 0
        spec = req.speculation or self.spec_config
        return max(0, min(spec.num_speculative_tokens, self._room(req) - 1 - len(forced)))

    def _forced(self, req: Request) -> list[int]:
        if req.grammar is None or not self.jump_forward:
            return []
        # A step emits at most the forced tokens + 1.
        return req.grammar.forced(min(MAX_FORCED, self._room(req) - 1))

    def spec_limits(self, req: Request, forced: tuple[int, ...]) -> tuple[int, int, int]:
        """(max draft depth, max draft nodes, top-k) for a decoding request this step, below its
        `forced` tokens; depth 0 = plain."""
        if self.drafter is None or not req.speculate:
            return 0, 0, 1
        spec = req.speculation or self.spec_config
        nodes = spec.max_nodes
        cap = self._caps.get(req.seq_id)
        if not pinned(req) and cap is not None:
            nodes = min(nodes, cap)
        # A step emits at most forced + depth + 1 tokens.
        depth = min(spec.num_speculative_tokens, self._room(req) - 1 - len(forced), nodes)
        if depth < 1:
            return 0, 0, 1
        return depth, nodes, spec.topk

    # ---- draft --------------------------------------------------------------------------------
    def draft(self, sched: SchedulerOutput) -> list[SeqPlan]:
        """One plan per scheduled sequence; decoding requests given tree slots get a proposal."""
        plans = [SeqPlan(s) for s in sched.seqs]
        for plan in plans:
            plan.fault = plan.seq.ahead.fault
        picked = [p for p in plans if p.seq.num_lookahead and not p.request.in_prefill and p.fault is None]
        for plan in picked:
            if plan.seq.ahead.forced:
                plan.proposal = forced_proposal(plan.request.token_ids[-1], list(plan.seq.ahead.forced))
                plan.forced = len(plan.seq.ahead.forced)
        drafted = [p for p in picked if p.seq.num_lookahead > p.forced]
        proposed = [(p, prop) for p, prop in zip(drafted, self._proposals(drafted)) if prop is not None]
        drafted = [p for p, _ in proposed]
        props = self._trim(drafted, [prop for _, prop in proposed], plans)
        for plan, prop in zip(drafted, props):
            if prop is None:        # the adaptive controller kept none of it: a plain decode step
                continue
            plan.drafted = prop
            if not plan.forced:
                plan.proposal = prop
            elif prop.draft is None:        # point masses below the chain (drafts_ahead drafters)
                plan.proposal = forced_proposal(plan.request.token_ids[-1], list(plan.seq.ahead.forced), prop.tree)
        return plans

    def _trim(self, drafted: list[SeqPlan], props: list[Proposal], plans: list[SeqPlan]) -> list:
        """The proposals cut to the draft nodes the adaptive controller verifies (None where it
        keeps none, or the drafter proposed none: a plain decode step, without a tree's mask
        and acceptance). A request below a forced chain or a pinned one keeps its whole
        proposal, a bare root included (its draws follow the tree path)."""
        if not props:
            return []
        free = [not plan.forced and not pinned(plan.request) for plan in drafted]
        props = [None if f and not prop.num_draft_nodes else prop for f, prop in zip(free, props)]
        cut = [i for i, (f, plan, prop) in enumerate(zip(free, drafted, props))
               if f and prop is not None and plan.request.history is not None]
        others = [i for i in set(range(len(drafted))) - set(cut) if props[i] is not None]
        base_rows = sum(p.num_rows for p in plans if p not in drafted) + len(cut) \
            + sum(drafted[i].forced + props[i].num_draft_nodes for i in others)
        decoding = sum(1 for p in plans if not p.mid_prefill)
        # a prompt chunk's rows, less the row a finishing prompt samples its first token from
        prompt_rows = sum(p.num_rows - (not p.mid_prefill) for p in plans if p not in drafted and p.is_prompt)
        keep = self.adaptive.trim([candidate(drafted[i].request, props[i]) for i in cut], decoding, base_rows,
                                  prompt_rows=prompt_rows)
        out = list(props)
        for i, k in zip(cut, keep):
            out[i] = props[i].truncated(k) if k else None
        return out

    def _proposals(self, drafted: list[SeqPlan]) -> list[Proposal | None]:
        """Per plan, the drafter's proposal joined with its request's prediction chain; None
        where there is neither (the drafter failed: a plain decode step)."""
        asking = [p for p in drafted if self._drafter_nodes(p.request, p.seq.ahead.forced)]
        own = dict(zip((p.request.seq_id for p in asking), self._propose(asking)))    # empty if the drafter failed
        return [self._with_prediction(p, own.get(p.request.seq_id)) for p in drafted]

    def _with_prediction(self, plan: SeqPlan, own: Proposal | None) -> Proposal | None:
        """The request's prediction chain joined with the drafter's proposal `own` (drafters/prediction.py)."""
        req, forced = plan.request, plan.seq.ahead.forced
        if req.prediction is None:
            return own
        depth = self._prediction_depth(req, forced)
        try:
            chain = self.predictor.propose([self._view(req, forced, (depth, depth, 1))])[0]
        except Exception:  # a bug here must not fail the request: the drafter's proposal alone
            self.errors += 1
            log.exception("drafting the prediction of seq %d failed", req.seq_id)
            return own
        plan.predicted = chain.tree.tokens[1:]
        return join_prediction(chain, own, max(self._drafter_nodes(req, forced), depth))

    def _propose(self, plans: list[SeqPlan]) -> list[Proposal]:
        """The drafter's trees for the plans' requests, in order; none at all (plain decoding) if it raises."""
        if not plans:
            return []
        views = [self._view(p.request, p.seq.ahead.forced, self.spec_limits(p.request, p.seq.ahead.forced))
                 for p in plans]
        start = time.perf_counter()
        try:
            props = self.drafter.propose(views)
            self.step = StepDrafts(time.perf_counter() - start, len(views), sum(p.num_draft_nodes for p in props))
        except Exception:  # a drafter bug must not fail requests: decode plainly this step
            self.errors += 1
            log.exception("drafter %s failed; decoding %d requests plainly this step",
                          self.drafter.name, len(views))
            return []
        for view, prop in zip(views, props):
            if prop.tree.tokens[0] != view.token_ids[-1] or prop.num_draft_nodes > view.max_nodes:
                raise AssertionError(f"drafter {self.drafter.name} broke its contract for seq {view.seq_id}")
        return props

    def _view(self, r: Request, forced: tuple[int, ...], limits: tuple[int, int, int]) -> DraftRequest:
        """What a drafter sees of a request this step: its tokens, then the forced ones (unverified),
        and its tree's (max depth, max nodes, top-k)."""
        return DraftRequest(r.seq_id, r.token_ids + list(forced), r.params, r.generator, *limits,
                            unverified=len(forced), num_prompt=r.num_prompt_tokens, prediction=r.prediction,
                            held_back=self.held_back(r.params), adapter=self.adapters.name(r.adapter))

    # ---- what the drafter learns beside the step ------------------------------------------------
    def prefill(self, plans: list[SeqPlan]) -> None:
        """Hand the drafter the prompt chunks the target just ran, for its own KV."""
        if self.drafter is None:
            return
        chunks = [PrefillChunk(p.request.seq_id, p.request.token_ids, p.ctx_len,
                               p.ctx_len + p.seq.num_new_tokens, self.adapters.name(p.request.adapter))
                  for p in plans if p.is_prompt and p.request.speculate and p.fault is None]
        if chunks:
            try:
                self.drafter.prefill(chunks)
            except Exception:   # the drafter catches up later from its own bookkeeping
                self.errors += 1
                log.exception("drafter %s failed to prefill", self.drafter.name)

    def observe(self, plans: list[SeqPlan], fwd: ForwardOutput | None) -> None:
        """Hand the tapped hidden states of kept positions to a feature-reading drafter."""
        if self.drafter is None or not self.drafter.capture_layers or fwd is None:
            return
        live = [p for p in plans if p.request.speculate and not p.request.finished]
        if not live:
            return
        rows = [p.kept_rows for p in live]
        # [new tokens, sum of tapped widths]: rows as laid out by the engine's verify
        hidden = torch.cat([fwd.hidden[layer] for layer in self.drafter.capture_layers], dim=-1)
        index = torch.tensor([r for rs in rows for r in rs], device=hidden.device)
        parts = hidden.index_select(0, index).split([len(rs) for rs in rows])
        try:
            self.drafter.observe([TargetHidden(p.request.seq_id, p.ctx_len, h) for p, h in zip(live, parts)])
        except Exception:   # a drafter bug must not fail requests
            self.errors += 1
            log.exception("drafter %s failed to observe target states", self.drafter.name)

    def learn(self, req: Request) -> None:
        """Hand a finished output to the drafter; a drafter bug must not fail the request."""
        if self.drafter is None:
            return
        try:
            self.drafter.finish(req.seq_id, req.token_ids, req.num_prompt_tokens)
        except Exception:
            self.errors += 1
            log.exception("drafter %s failed to learn seq %d's output", self.drafter.name, req.seq_id)

    def release(self, req: Request) -> None:
        self.predictor.release(req.seq_id)
        if self.drafter is not None:
            self.drafter.release(req.seq_id)
