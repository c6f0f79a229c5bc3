"""The accept phase: each plan's tokens from the target's logits. A tree: its accepted path plus
one corrected or bonus token (exact rejection sampling, spec/rejection.py). A plain decode step
or a prompt's last chunk: one token sampled from its last row. A mid-prompt chunk: none. A
constrained request's masks apply first; its requested logprobs, and the request's speculation
counters, are filled in here.
"""
from __future__ import annotations

from typing import Callable

import torch

from spec.adaptive import AdaptiveController
from spec.drafting import candidate
from spec.faults import NO_TOKEN_ALLOWED, RequestFault
from spec.plan import SeqPlan
from spec.rejection import accept_greedy, accept_tree
from spec.request import Request
from verifier.sampling.grammar import apply_bitmask
from verifier.sampling.logprobs import TokenLogprob, decided, row_logprob
from verifier.sampling.sampler import greedy_token, sample_token, target_probs, transform_logits
from verifier.sampling.sampling_params import SamplingParams


def held_back(p: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids min_tokens masks (none without it): what would end the request."""
    return p.finishing_ids(eos_ids) if p.min_tokens else frozenset()


class Acceptance:
    def __init__(self, adaptive: AdaptiveController, logprobs_mode: str,
                 held_back: Callable[[SamplingParams], frozenset[int]]):
        """`adaptive` learns from each drafted tree's acceptance; `logprobs_mode`: "raw" or
        "processed" (verifier/sampling/logprobs.py)."""
        self.adaptive, self.logprobs_mode, self.held_back = adaptive, logprobs_mode, held_back

    def accept(self, plan: SeqPlan) -> None:
        req = plan.request
        if plan.masks is not None and plan.logits.shape[0]:
            # in place: the rows of this forward only
            apply_bitmask(plan.logits, plan.masks[plan.logit_rows])
            if plan.proposal is None and not torch.isfinite(plan.logits).any(-1).all():
                raise RequestFault(NO_TOKEN_ALLOWED)
        if plan.proposal is not None:
            plan.accepted, plan.tokens = self._proposal(req, plan)
            # the forced chain is nodes 1..forced: the accepted path runs through it first
            plan.forced_accepted = sum(1 for j in plan.accepted if j <= plan.forced)
            req.spec.forced_tokens += plan.forced_accepted
            if plan.predicted:
                self._count_prediction(req, plan)
            if plan.drafted is not None:
                self._count(req, plan.proposal.num_draft_nodes - plan.forced,
                            plan.proposal.tree.max_depth - plan.forced, len(plan.accepted) - plan.forced_accepted)
                if not plan.forced and plan.masks is None and req.history is not None:
                    self.adaptive.observe(candidate(req, plan.proposal), plan.accepted)
        elif not plan.mid_prefill and plan.sole and plan.sole[0] >= 0:
            plan.tokens = [plan.sole[0]]                # the grammar allows this one token
        elif not plan.mid_prefill:
            plan.tokens = [sample_token(plan.logits[-1], req.params, req.prompt_token_ids,
                                        req.output_token_ids, req.generator, self.held_back(req.params))]
        if plan.tokens and req.params.logprobs is not None:
            plan.logprobs = self._logprobs(plan)

    def _logprobs(self, plan: SeqPlan) -> list[TokenLogprob]:
        """Each chosen token's logprob under the row that predicted it: a tree's root, then its
        accepted nodes; a plain step's last row. Rows the grammar decides have no logits."""
        req, k = plan.request, plan.request.params.logprobs
        if plan.proposal is None:
            if plan.sole and plan.sole[0] >= 0:
                return [decided(plan.tokens[0], k)]
            return [row_logprob(plan.logits[-1], plan.tokens[0], k, self.logprobs_mode, req.params,
                                req.prompt_token_ids, req.output_token_ids, self.held_back(req.params))]
        tree, rows = plan.proposal.tree, {u: i for i, u in enumerate(plan.logit_rows)}
        out = []
        for u, token in zip((0, *plan.accepted), plan.tokens):
            if u not in rows:
                out.append(decided(token, k))
            else:
                before = req.output_token_ids + tree.path_tokens(u)[1:]
                out.append(row_logprob(plan.logits[rows[u]], token, k, self.logprobs_mode, req.params,
                                       req.prompt_token_ids, before, self.held_back(req.params)))
        return out

    def _proposal(self, req: Request, plan: SeqPlan) -> tuple[tuple[int, ...], list[int]]:
        """Exact acceptance over the plan's verified tree (plan.logits: a raw row per
        plan.logit_rows node); returns the accepted tree nodes and the tokens to emit. A node
        whose grammar allows one token (plan.sole) has the one-hot distribution on it."""
        prop, logits, sole = plan.proposal, plan.logits, plan.sole
        tree, p = prop.tree, req.params
        prompt, output, held = req.prompt_token_ids, req.output_token_ids, self.held_back(p)
        row = [-1] * tree.num_nodes                 # node -> its logits row, -1 where it has none
        for i, u in enumerate(plan.logit_rows):
            row[u] = i
        # rows the grammar leaves nothing in (a dead end): the request fails if acceptance reaches one
        dead = (~torch.isfinite(logits).any(-1)).tolist() if plan.masks is not None else [False] * len(row)

        def node_logits(u: int) -> torch.Tensor:
            if dead[row[u]]:
                raise RequestFault(NO_TOKEN_ALLOWED)
            # Penalties and min_tokens see every token up to node u: the output plus u's path below the root.
            return transform_logits(logits[row[u]], p, prompt, output + tree.path_tokens(u)[1:], held)

        def node_probs(u: int) -> torch.Tensor:
            if row[u] < 0:
                one_hot = torch.zeros(logits.shape[-1], device=logits.device)
                one_hot[sole[u]] = 1.0
                return one_hot
            return target_probs(node_logits(u)[None], p)[0]

        if p.greedy:
            result = accept_greedy(tree, lambda u: sole[u] if row[u] < 0 else greedy_token(node_logits(u)))
        else:
            result = accept_tree(tree, node_probs, prop.draft, req.generator)
        return result.accepted, [tree.tokens[j] for j in result.accepted] + [result.token]

    @staticmethod
    def _count_prediction(req: Request, plan: SeqPlan) -> None:
        """The prediction's tokens verified this step (what the cut and the grammar left of its
        chain) and how many of them were accepted."""
        nodes = plan.proposal.tree.follow(plan.predicted, plan.forced)
        accepted = len(set(nodes) & set(plan.accepted))
        req.spec.prediction_accepted += accepted
        req.spec.prediction_rejected += len(nodes) - accepted

    @staticmethod
    def _count(req: Request, nodes: int, max_depth: int, accepted: int) -> None:
        """Verify steps with at least one of the drafter's nodes (a bare root is a plain decode
        step): its nodes, the tree's depth and how many of them were accepted."""
        if not nodes:
            return
        st = req.spec
        st.verify_steps += 1
        st.draft_tokens += nodes
        st.accepted_tokens += accepted
        while len(st.accepted_per_depth) < max_depth:
            st.accepted_per_depth.append(0)
        for d in range(accepted):
            st.accepted_per_depth[d] += 1
